//! A small msgpack reader for tests: payloads as a value tree, integers kept exact.

/// A decoded msgpack value.
#[derive(Debug, Clone, PartialEq)]
pub enum V {
    Nil,
    Bool(bool),
    /// Non-negative integer.
    U(u64),
    /// Negative integer.
    I(i64),
    F(f64),
    S(String),
    Bin(Vec<u8>),
    A(Vec<V>),
    /// Entries in wire order.
    M(Vec<(String, V)>),
}

impl V {
    pub fn get(&self, key: &str) -> Option<&V> {
        match self {
            V::M(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn keys(&self) -> Vec<&str> {
        match self {
            V::M(entries) => entries.iter().map(|(k, _)| k.as_str()).collect(),
            _ => Vec::new(),
        }
    }

    pub fn array(&self) -> &[V] {
        match self {
            V::A(items) => items,
            _ => panic!("not an array: {self:?}"),
        }
    }

    pub fn str(&self) -> &str {
        match self {
            V::S(s) => s,
            _ => panic!("not a string: {self:?}"),
        }
    }

    /// An integer as its 64 bits (negative values in two's complement).
    pub fn bits(&self) -> u64 {
        match self {
            V::U(v) => *v,
            V::I(v) => *v as u64,
            _ => panic!("not an integer: {self:?}"),
        }
    }
}

pub fn decode(bytes: &[u8]) -> V {
    let mut pos = 0;
    let v = read(bytes, &mut pos);
    assert_eq!(pos, bytes.len(), "trailing bytes after the value");
    v
}

fn take<'a>(b: &'a [u8], pos: &mut usize, n: usize) -> &'a [u8] {
    let s = &b[*pos..*pos + n];
    *pos += n;
    s
}

fn be(b: &[u8], pos: &mut usize, n: usize) -> u64 {
    take(b, pos, n)
        .iter()
        .fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
}

fn read(b: &[u8], pos: &mut usize) -> V {
    let m = take(b, pos, 1)[0];
    match m {
        0x00..=0x7f => V::U(u64::from(m)),
        0x80..=0x8f => map(b, pos, usize::from(m & 0x0f)),
        0x90..=0x9f => array(b, pos, usize::from(m & 0x0f)),
        0xa0..=0xbf => string(b, pos, usize::from(m & 0x1f)),
        0xc0 => V::Nil,
        0xc2 => V::Bool(false),
        0xc3 => V::Bool(true),
        0xc4..=0xc6 => {
            let n = be(b, pos, 1 << (m - 0xc4)) as usize;
            V::Bin(take(b, pos, n).to_vec())
        }
        0xcb => V::F(f64::from_bits(be(b, pos, 8))),
        0xcc..=0xcf => V::U(be(b, pos, 1 << (m - 0xcc))),
        0xd0 => V::I(i64::from(take(b, pos, 1)[0] as i8)),
        0xd1 => V::I(i64::from(be(b, pos, 2) as u16 as i16)),
        0xd2 => V::I(i64::from(be(b, pos, 4) as u32 as i32)),
        0xd3 => V::I(be(b, pos, 8) as i64),
        0xd9..=0xdb => {
            let n = be(b, pos, 1 << (m - 0xd9)) as usize;
            string(b, pos, n)
        }
        0xdc | 0xdd => {
            let n = be(b, pos, if m == 0xdc { 2 } else { 4 }) as usize;
            array(b, pos, n)
        }
        0xde | 0xdf => {
            let n = be(b, pos, if m == 0xde { 2 } else { 4 }) as usize;
            map(b, pos, n)
        }
        0xe0..=0xff => V::I(i64::from(m as i8)),
        other => panic!("unsupported msgpack marker {other:#x}"),
    }
}

fn string(b: &[u8], pos: &mut usize, n: usize) -> V {
    V::S(String::from_utf8(take(b, pos, n).to_vec()).expect("utf-8 string"))
}

fn array(b: &[u8], pos: &mut usize, n: usize) -> V {
    V::A((0..n).map(|_| read(b, pos)).collect())
}

fn map(b: &[u8], pos: &mut usize, n: usize) -> V {
    V::M(
        (0..n)
            .map(|_| {
                let key = match read(b, pos) {
                    V::S(s) => s,
                    other => panic!("non-string key {other:?}"),
                };
                (key, read(b, pos))
            })
            .collect(),
    )
}
