//! Writing msgpack: the inverse of the decoder's reader, for whatever must
//! produce engine payloads (the mock engine, tests, benchmarks).
//!
//! Every function appends one value or header to a byte buffer. The plain
//! forms pick the shortest encoding, as the engines' msgspec encoder does;
//! [`uint64`] and [`int64`] always take the 8-byte form, which the engines
//! never write for small values but a tolerant decoder must still read.

/// `nil`.
pub fn nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

/// A non-negative integer in its shortest form.
pub fn uint(out: &mut Vec<u8>, v: u64) {
    match v {
        0..=0x7f => out.push(v as u8),
        0x80..=0xff => out.extend_from_slice(&[0xcc, v as u8]),
        0x100..=0xffff => {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        }
        _ => uint64(out, v),
    }
}

/// A non-negative integer as `uint64`, whatever its size.
pub fn uint64(out: &mut Vec<u8>, v: u64) {
    out.push(0xcf);
    out.extend_from_slice(&v.to_be_bytes());
}

/// A signed integer: non-negative values as [`uint`], negative ones in the
/// shortest signed form.
pub fn int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        uint(out, v as u64);
    } else if v >= -32 {
        out.push(v as i8 as u8);
    } else if v >= i64::from(i8::MIN) {
        out.extend_from_slice(&[0xd0, v as i8 as u8]);
    } else if v >= i64::from(i16::MIN) {
        out.push(0xd1);
        out.extend_from_slice(&(v as i16).to_be_bytes());
    } else if v >= i64::from(i32::MIN) {
        out.push(0xd2);
        out.extend_from_slice(&(v as i32).to_be_bytes());
    } else {
        int64(out, v);
    }
}

/// A signed integer as `int64`, whatever its size.
pub fn int64(out: &mut Vec<u8>, v: i64) {
    out.push(0xd3);
    out.extend_from_slice(&v.to_be_bytes());
}

/// A `float64` (msgspec writes every Python float in 64 bits).
pub fn f64(out: &mut Vec<u8>, v: f64) {
    out.push(0xcb);
    out.extend_from_slice(&v.to_be_bytes());
}

/// A UTF-8 string.
pub fn str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    match n {
        0..=31 => out.push(0xa0 | n as u8),
        32..=0xff => out.extend_from_slice(&[0xd9, n as u8]),
        0x100..=0xffff => {
            out.push(0xda);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(0xdb);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
    out.extend_from_slice(s.as_bytes());
}

/// A byte string (`bin`).
pub fn bin(out: &mut Vec<u8>, b: &[u8]) {
    let n = b.len();
    match n {
        0..=0xff => out.extend_from_slice(&[0xc4, n as u8]),
        0x100..=0xffff => {
            out.push(0xc5);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(0xc6);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
    out.extend_from_slice(b);
}

/// An array header for `n` elements.
pub fn array(out: &mut Vec<u8>, n: usize) {
    match n {
        0..=15 => out.push(0x90 | n as u8),
        16..=0xffff => {
            out.push(0xdc);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(0xdd);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

/// A map header for `n` entries, shortest form.
pub fn map(out: &mut Vec<u8>, n: usize) {
    match n {
        0..=15 => out.push(0x80 | n as u8),
        16..=0xffff => map16(out, n as u16),
        _ => {
            out.push(0xdf);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

/// A `map16` header even for few entries: msgspec sizes a struct's header by
/// its declared field count, so a struct of 16 or more fields always gets one.
pub fn map16(out: &mut Vec<u8>, n: u16) {
    out.push(0xde);
    out.extend_from_slice(&n.to_be_bytes());
}

/// An array of non-negative integers, each in its shortest form.
pub fn uints(out: &mut Vec<u8>, values: &[u64]) {
    array(out, values.len());
    for &v in values {
        uint(out, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(write: impl Fn(&mut Vec<u8>)) -> Vec<u8> {
        let mut out = Vec::new();
        write(&mut out);
        out
    }

    #[test]
    fn integers_take_the_shortest_form_unless_asked_for_eight_bytes() {
        assert_eq!(bytes(|o| uint(o, 5)), [5]);
        assert_eq!(bytes(|o| uint(o, 200)), [0xcc, 200]);
        assert_eq!(bytes(|o| uint(o, 0x1234)), [0xcd, 0x12, 0x34]);
        assert_eq!(bytes(|o| uint(o, 0x1_0000)), [0xce, 0, 1, 0, 0]);
        assert_eq!(bytes(|o| uint(o, 1 << 40))[0], 0xcf);
        assert_eq!(bytes(|o| uint64(o, 1)), [0xcf, 0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(bytes(|o| int(o, -1)), [0xff]);
        assert_eq!(bytes(|o| int(o, -100)), [0xd0, 0x9c]);
        assert_eq!(bytes(|o| int(o, -1000))[0], 0xd1);
        assert_eq!(bytes(|o| int(o, -100_000))[0], 0xd2);
        assert_eq!(bytes(|o| int(o, i64::MIN))[0], 0xd3);
        assert_eq!(bytes(|o| int64(o, -1))[0], 0xd3);
        assert_eq!(bytes(|o| int(o, 7)), [7]);
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn every_integer_width_boundary_matches_msgspec() {
        let mut out = Vec::new();
        for v in [
            0u64,
            127,
            128,
            255,
            256,
            65535,
            65536,
            u64::from(u32::MAX),
            1 << 63,
        ] {
            uint(&mut out, v);
        }
        for v in [
            -1i64,
            -32,
            -33,
            -128,
            -129,
            -32768,
            -32769,
            i64::from(i32::MIN) - 1,
        ] {
            int(&mut out, v);
        }
        assert_eq!(
            hex(&out),
            "007fcc80ccffcd0100cdffffce00010000ceffffffffcf8000000000000000\
             ffe0d0dfd080d1ff7fd18000d2ffff7fffd3ffffffff7fffffff"
        );
    }

    #[test]
    fn strings_arrays_and_maps_switch_headers_at_msgpack_limits() {
        let mut out = Vec::new();
        str(&mut out, &"a".repeat(31));
        str(&mut out, &"b".repeat(32));
        array(&mut out, 15);
        array(&mut out, 16);
        map(&mut out, 15);
        map(&mut out, 16);
        assert_eq!(out[0], 0xbf);
        assert_eq!(&out[32..34], &[0xd9, 32]);
        assert_eq!(&out[66..], &[0x9f, 0xdc, 0, 16, 0x8f, 0xde, 0, 16]);
    }

    #[test]
    fn headers_grow_with_their_length() {
        assert_eq!(bytes(|o| array(o, 3)), [0x93]);
        assert_eq!(bytes(|o| array(o, 16)), [0xdc, 0, 16]);
        assert_eq!(bytes(|o| array(o, 70_000))[0], 0xdd);
        assert_eq!(bytes(|o| map(o, 2)), [0x82]);
        assert_eq!(bytes(|o| map(o, 20)), [0xde, 0, 20]);
        assert_eq!(bytes(|o| map16(o, 2)), [0xde, 0, 2]);
        assert_eq!(bytes(|o| str(o, "ab")), [0xa2, b'a', b'b']);
        assert_eq!(bytes(|o| str(o, &"x".repeat(40)))[..2], [0xd9, 40]);
        assert_eq!(bytes(|o| str(o, &"x".repeat(300)))[0], 0xda);
        assert_eq!(bytes(|o| bin(o, &[1, 2])), [0xc4, 2, 1, 2]);
        assert_eq!(bytes(|o| uints(o, &[1, 300])), [0x92, 1, 0xcd, 1, 44]);
        assert_eq!(bytes(nil), [0xc0]);
    }
}
