//! A bounds-checked msgpack reader over a borrowed payload.
//!
//! Only what the event decoder needs: typed reads that borrow strings and bins
//! from the payload, integer reads straight from the bytes (so token ids are
//! hashed without first building a token list), and [`Reader::skip_value`],
//! which finds the end of any value without recursion. Finding a value's end
//! from its markers alone is what lets the decoder skip one bad event and go on
//! with the next. Every read checks bounds; nothing here can panic.

use std::fmt;

/// The msgpack family of a value, from its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
    /// The reserved byte `0xc1`, never valid.
    Reserved,
}

impl Kind {
    pub(crate) fn of(marker: u8) -> Kind {
        match marker {
            0x00..=0x7f | 0xcc..=0xd3 | 0xe0..=0xff => Kind::Int,
            0x80..=0x8f | 0xde | 0xdf => Kind::Map,
            0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
            0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
            0xc0 => Kind::Nil,
            0xc1 => Kind::Reserved,
            0xc2 | 0xc3 => Kind::Bool,
            0xc4..=0xc6 => Kind::Bin,
            0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
            0xca | 0xcb => Kind::Float,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Nil => "nil",
            Kind::Bool => "bool",
            Kind::Int => "integer",
            Kind::Float => "float",
            Kind::Str => "string",
            Kind::Bin => "bin",
            Kind::Array => "array",
            Kind::Map => "map",
            Kind::Ext => "ext",
            Kind::Reserved => "reserved byte 0xc1",
        }
    }
}

/// Why a read failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReadError {
    /// The payload ended inside a value.
    Truncated { offset: usize },
    /// The reserved marker `0xc1`.
    Reserved { offset: usize },
    /// A well-formed value of the wrong family.
    Type {
        offset: usize,
        expected: &'static str,
        found: Kind,
    },
    /// An integer that does not fit the expected range.
    Range {
        offset: usize,
        value: Int,
        expected: &'static str,
    },
    /// A string that is not UTF-8.
    Utf8 { offset: usize },
}

impl ReadError {
    /// True when the payload itself is broken (as opposed to a value of the wrong type):
    /// after such an error the end of the enclosing value cannot be found.
    pub(crate) fn is_structural(&self) -> bool {
        matches!(
            self,
            ReadError::Truncated { .. } | ReadError::Reserved { .. }
        )
    }
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Truncated { offset } => {
                write!(f, "payload ends inside a value at byte {offset}")
            }
            ReadError::Reserved { offset } => {
                write!(f, "invalid msgpack byte 0xc1 at byte {offset}")
            }
            ReadError::Type {
                offset,
                expected,
                found,
            } => {
                write!(
                    f,
                    "expected {expected}, found {} at byte {offset}",
                    found.name()
                )
            }
            ReadError::Range {
                offset,
                value,
                expected,
            } => {
                write!(f, "expected {expected}, found {value} at byte {offset}")
            }
            ReadError::Utf8 { offset } => write!(f, "string is not UTF-8 at byte {offset}"),
        }
    }
}

/// A msgpack integer: non-negative values as `u64`, negative ones as `i64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int {
    Unsigned(u64),
    Negative(i64),
}

impl fmt::Display for Int {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Int::Unsigned(v) => write!(f, "{v}"),
            Int::Negative(v) => write!(f, "{v}"),
        }
    }
}

/// Total bytes of a value that is complete after its marker and a fixed or
/// marker-encoded length (ints, floats, nil, bools, fixstr, fixext); 0 for
/// values whose size needs more reading (containers, str8+, bin, ext8+).
const FIXED_WIDTH: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut m = 0;
    while m < 256 {
        table[m] = match m as u8 {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 1,
            0xa0..=0xbf => 1 + (m as u8 & 0x1f),
            0xcc | 0xd0 => 2,
            0xcd | 0xd1 => 3,
            0xd4 => 3,
            0xd5 => 4,
            0xca | 0xce | 0xd2 => 5,
            0xd6 => 6,
            0xcb | 0xcf | 0xd3 => 9,
            0xd7 => 10,
            0xd8 => 18,
            _ => 0,
        };
        m += 1;
    }
    table
};

/// A cursor over a msgpack payload.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

pub(crate) type Result<T> = std::result::Result<T, ReadError>;

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Byte offset of the next value.
    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    /// Bytes not yet read.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    #[cfg(test)]
    pub(crate) fn is_at_end(&self) -> bool {
        self.pos >= self.buf.len()
    }

    /// The family of the next value, without consuming it.
    pub(crate) fn peek_kind(&self) -> Result<Kind> {
        match self.buf.get(self.pos) {
            Some(&m) => Ok(Kind::of(m)),
            None => Err(ReadError::Truncated { offset: self.pos }),
        }
    }

    #[inline]
    fn byte(&mut self) -> Result<u8> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or(ReadError::Truncated { offset: self.pos })?;
        self.pos += 1;
        Ok(b)
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let out = &self.buf[self.pos..end];
                self.pos = end;
                Ok(out)
            }
            None => Err(ReadError::Truncated {
                offset: self.buf.len(),
            }),
        }
    }

    #[inline]
    fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let bytes = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    #[inline]
    fn be_len(&mut self, width: usize) -> Result<usize> {
        Ok(match width {
            1 => self.byte()? as usize,
            2 => u16::from_be_bytes(self.be()?) as usize,
            _ => u32::from_be_bytes(self.be()?) as usize,
        })
    }

    fn type_error(&self, offset: usize, expected: &'static str) -> ReadError {
        ReadError::Type {
            offset,
            expected,
            found: Kind::of(self.buf.get(offset).copied().unwrap_or(0xc1)),
        }
    }

    /// Consumes a nil and returns true, or leaves any other value and returns false.
    pub(crate) fn eat_nil(&mut self) -> bool {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Reads any integer.
    #[inline]
    pub(crate) fn read_int(&mut self) -> Result<Int> {
        let offset = self.pos;
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => Int::Unsigned(m as u64),
            0xe0..=0xff => Int::Negative(m as i8 as i64),
            0xcc => Int::Unsigned(self.byte()? as u64),
            0xcd => Int::Unsigned(u16::from_be_bytes(self.be()?) as u64),
            0xce => Int::Unsigned(u32::from_be_bytes(self.be()?) as u64),
            0xcf => Int::Unsigned(u64::from_be_bytes(self.be()?)),
            0xd0 => signed(i8::from_be_bytes(self.be()?) as i64),
            0xd1 => signed(i16::from_be_bytes(self.be()?) as i64),
            0xd2 => signed(i32::from_be_bytes(self.be()?) as i64),
            0xd3 => signed(i64::from_be_bytes(self.be()?)),
            _ => {
                self.pos = offset;
                return Err(self.type_error(offset, "integer"));
            }
        })
    }

    /// Reads a non-negative integer (a token id, a size, an index).
    #[inline(always)]
    pub(crate) fn read_u64(&mut self) -> Result<u64> {
        let pos = self.pos;
        if let Some(&m) = self.buf.get(pos) {
            if m < 0x80 {
                // Positive fixint: small ids.
                self.pos = pos + 1;
                return Ok(m as u64);
            }
            if (0xcc..=0xcf).contains(&m) {
                // uint8/16/32/64: load 8 bytes after the marker and shift the
                // unused ones away, so mixed widths cost no unpredictable branch.
                let width = 1usize << (m - 0xcc);
                if let Some(bytes) = self.buf.get(pos + 1..pos + 9) {
                    let mut word = [0u8; 8];
                    word.copy_from_slice(bytes);
                    self.pos = pos + 1 + width;
                    return Ok(u64::from_be_bytes(word) >> (8 * (8 - width)));
                }
            }
        }
        self.read_u64_slow()
    }

    #[cold]
    fn read_u64_slow(&mut self) -> Result<u64> {
        let offset = self.pos;
        match self.read_int()? {
            Int::Unsigned(v) => Ok(v),
            value @ Int::Negative(_) => Err(ReadError::Range {
                offset,
                value,
                expected: "a non-negative integer",
            }),
        }
    }

    /// Reads a non-negative integer that must fit in `u32`.
    pub(crate) fn read_u32(&mut self) -> Result<u32> {
        let offset = self.pos;
        let v = self.read_u64()?;
        u32::try_from(v).map_err(|_| ReadError::Range {
            offset,
            value: Int::Unsigned(v),
            expected: "an integer below 2^32",
        })
    }

    /// Reads a UTF-8 string borrowed from the payload.
    pub(crate) fn read_str(&mut self) -> Result<&'a str> {
        let offset = self.pos;
        let m = self.byte()?;
        let len = match m {
            0xa0..=0xbf => (m & 0x1f) as usize,
            0xd9 => self.be_len(1)?,
            0xda => self.be_len(2)?,
            0xdb => self.be_len(4)?,
            _ => {
                self.pos = offset;
                return Err(self.type_error(offset, "string"));
            }
        };
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes).map_err(|_| ReadError::Utf8 { offset })
    }

    /// Reads a map key: `Some` for a UTF-8 string, `None` (with the key skipped)
    /// for any other well-formed value, an error only when the payload is broken.
    pub(crate) fn read_key(&mut self) -> Result<Option<&'a str>> {
        let mut probe = self.clone();
        match probe.read_str() {
            Ok(key) => {
                *self = probe;
                Ok(Some(key))
            }
            Err(e) if e.is_structural() => Err(e),
            Err(_) => self.skip_value().map(|()| None),
        }
    }

    /// Reads a bin borrowed from the payload.
    pub(crate) fn read_bin(&mut self) -> Result<&'a [u8]> {
        let offset = self.pos;
        let m = self.byte()?;
        let len = match m {
            0xc4 => self.be_len(1)?,
            0xc5 => self.be_len(2)?,
            0xc6 => self.be_len(4)?,
            _ => {
                self.pos = offset;
                return Err(self.type_error(offset, "bin"));
            }
        };
        self.take(len)
    }

    /// Reads a float, accepting integers too (msgpack writers may encode `ts` as an int).
    pub(crate) fn read_f64(&mut self) -> Result<f64> {
        let offset = self.pos;
        match self.byte()? {
            0xca => Ok(f32::from_be_bytes(self.be()?) as f64),
            0xcb => Ok(f64::from_be_bytes(self.be()?)),
            _ => {
                self.pos = offset;
                match self.read_int() {
                    Ok(Int::Unsigned(v)) => Ok(v as f64),
                    Ok(Int::Negative(v)) => Ok(v as f64),
                    Err(_) => Err(self.type_error(offset, "float")),
                }
            }
        }
    }

    /// Reads an array header and returns its element count.
    pub(crate) fn read_array_len(&mut self) -> Result<usize> {
        let offset = self.pos;
        let m = self.byte()?;
        match m {
            0x90..=0x9f => Ok((m & 0x0f) as usize),
            0xdc => self.be_len(2),
            0xdd => self.be_len(4),
            _ => {
                self.pos = offset;
                Err(self.type_error(offset, "array"))
            }
        }
    }

    /// Reads a map header and returns its entry count.
    pub(crate) fn read_map_len(&mut self) -> Result<usize> {
        let offset = self.pos;
        let m = self.byte()?;
        match m {
            0x80..=0x8f => Ok((m & 0x0f) as usize),
            0xde => self.be_len(2),
            0xdf => self.be_len(4),
            _ => {
                self.pos = offset;
                Err(self.type_error(offset, "map"))
            }
        }
    }

    /// Skips one complete value of any type, nested or not, without recursion.
    pub(crate) fn skip_value(&mut self) -> Result<()> {
        // Values still to skip; every value takes at least one byte, so a
        // lying length runs into the end of the payload, not into memory.
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            let offset = self.pos;
            let m = *self
                .buf
                .get(offset)
                .ok_or(ReadError::Truncated { offset })?;
            let width = FIXED_WIDTH[m as usize] as usize;
            if width != 0 {
                // The common case (token ids, hashes, short strings): one table lookup.
                self.pos += width;
                if self.pos > self.buf.len() {
                    return Err(ReadError::Truncated {
                        offset: self.buf.len(),
                    });
                }
                continue;
            }
            self.pos += 1;
            match m {
                0x80..=0x8f => pending += 2 * (m & 0x0f) as u64,
                0x90..=0x9f => pending += (m & 0x0f) as u64,
                0xc1 => return Err(ReadError::Reserved { offset }),
                0xc4 | 0xd9 => {
                    let n = self.be_len(1)?;
                    self.take(n)?;
                }
                0xc5 | 0xda => {
                    let n = self.be_len(2)?;
                    self.take(n)?;
                }
                0xc6 | 0xdb => {
                    let n = self.be_len(4)?;
                    self.take(n)?;
                }
                0xc7 => {
                    let n = self.be_len(1)?;
                    self.take(n + 1)?;
                }
                0xc8 => {
                    let n = self.be_len(2)?;
                    self.take(n + 1)?;
                }
                0xc9 => {
                    let n = self.be_len(4)?;
                    self.take(n.saturating_add(1))?;
                }
                0xdc => pending += self.be_len(2)? as u64,
                0xdd => pending += self.be_len(4)? as u64,
                0xde => pending += 2 * self.be_len(2)? as u64,
                0xdf => pending += 2 * self.be_len(4)? as u64,
                // Every other marker has a fixed width, handled above.
                _ => return Err(ReadError::Reserved { offset }),
            }
        }
        Ok(())
    }

    /// Skips one value and returns its bytes, so it can be read later by its own reader.
    pub(crate) fn value_bytes(&mut self) -> Result<&'a [u8]> {
        let start = self.pos;
        self.skip_value()?;
        Ok(&self.buf[start..self.pos])
    }
}

#[inline]
fn signed(v: i64) -> Int {
    if v >= 0 {
        Int::Unsigned(v as u64)
    } else {
        Int::Negative(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_of_every_width_decode() {
        let cases: &[(&[u8], Int)] = &[
            (&[0x05], Int::Unsigned(5)),
            (&[0xff], Int::Negative(-1)),
            (&[0xcc, 0xfa], Int::Unsigned(250)),
            (&[0xcd, 0x01, 0x00], Int::Unsigned(256)),
            (
                &[0xce, 0xff, 0xff, 0xff, 0xff],
                Int::Unsigned(u32::MAX as u64),
            ),
            (
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                Int::Unsigned(u64::MAX),
            ),
            (&[0xd0, 0x7f], Int::Unsigned(127)),
            (&[0xd1, 0xff, 0x00], Int::Negative(-256)),
            (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], Int::Negative(i64::MIN)),
        ];
        for (bytes, expected) in cases {
            let mut r = Reader::new(bytes);
            assert_eq!(r.read_int(), Ok(*expected), "{bytes:02x?}");
            assert!(r.is_at_end());
        }
    }

    #[test]
    fn skip_finds_the_end_of_nested_values() {
        // [ {"a": [1, "xy", nil]}, bin(2), 7 ] followed by a trailing 0x01
        let bytes = [
            0x93, 0x81, 0xa1, b'a', 0x93, 0x01, 0xa2, b'x', b'y', 0xc0, 0xc4, 0x02, 0xaa, 0xbb,
            0x07, 0x01,
        ];
        let mut r = Reader::new(&bytes);
        r.skip_value().expect("well-formed");
        assert_eq!(r.position(), bytes.len() - 1);
    }

    #[test]
    fn lying_lengths_fail_without_allocating() {
        let mut r = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]);
        assert!(matches!(r.skip_value(), Err(ReadError::Truncated { .. })));
        let mut r = Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(r.read_str(), Err(ReadError::Truncated { .. })));
    }

    #[test]
    fn a_type_error_leaves_the_value_in_place() {
        let mut r = Reader::new(&[0xa1, b'x']);
        assert!(matches!(
            r.read_int(),
            Err(ReadError::Type {
                found: Kind::Str,
                ..
            })
        ));
        assert_eq!(r.read_str(), Ok("x"));
    }
}
