//! Images in prompts: their identity, and the tokens each engine puts in their place.
//!
//! * **Identity**: the client's `mm_hashes` entry when given; otherwise the
//!   first 8 bytes (big-endian) of SHA-256 over the image bytes of a `data:`
//!   URL (base64-decoded when the URL says `;base64`, else the raw bytes after
//!   the comma). Any other URL is hashed as its string; nothing is fetched.
//! * **SGLang 0.5.23**: the image's `--mm-tokens-per-image` positions hold the
//!   item's four wide pad values cycled (`v0 v1 v2 v3 v0 …`), with
//!   `digest = sha256("sglang-mm-wide-pad-v1" ‖ BE8(identity))` and
//!   `v_k = 1_000_000 + (BE8(digest[8k..8k+8]) & (2^62 − 1))` (vector S5).
//! * **vLLM 0.33**: the positions hold the placeholder id (151655) and the
//!   image is named in each overlapping block's `extra_keys` as
//!   `[identifier, item start − block start]`; the identifier is a 64-hex
//!   digest whose first 16 hex digits are the identity (the full SHA-256 of the
//!   image bytes or URL, or the client's hash followed by 48 zeros).
//!
//! Both engines keep the vision start (151652) and end (151653) ids around the span.

use crate::hashing::{hex, sha256_of};

/// Offset of every multimodal pad value (`MM_PAD_SHIFT_VALUE`).
pub const MM_PAD_BASE: u64 = 1_000_000;
/// Mask of the 62-bit digest slice in a 0.5.23 wide pad value.
pub const WIDE_PAD_MASK: u64 = (1 << 62) - 1;
/// Domain separator of SGLang 0.5.23's pad derivation.
pub const WIDE_PAD_DOMAIN: &[u8] = b"sglang-mm-wide-pad-v1";

/// Why an image reference was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// A `data:` URL without a comma.
    #[error("data URL has no ',' separating the header from the data")]
    NoComma,
    /// Invalid base64.
    #[error("data URL base64 is invalid at byte {position}")]
    BadBase64 {
        /// Offset in the base64 text.
        position: usize,
    },
    /// An empty URL.
    #[error("image URL is empty")]
    Empty,
}

/// An image's identity in both forms the engines publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageIdentity {
    /// The 64-bit item hash (SGLang's pad seed; the first 16 hex digits of `identifier`).
    pub hash: u64,
    /// vLLM's `mm_identifier`: 64 lowercase hex digits.
    pub identifier: String,
}

impl ImageIdentity {
    /// The identity of an image given by URL (data URLs are decoded, others hashed as text).
    pub fn from_url(url: &str) -> Result<Self, ImageError> {
        if url.is_empty() {
            return Err(ImageError::Empty);
        }
        let digest = match url.strip_prefix("data:") {
            Some(rest) => {
                let (header, data) = rest.split_once(',').ok_or(ImageError::NoComma)?;
                if header.ends_with(";base64") {
                    sha256_of(&decode_base64(data)?)
                } else {
                    sha256_of(data.as_bytes())
                }
            }
            None => sha256_of(url.as_bytes()),
        };
        let mut head = [0u8; 8];
        head.copy_from_slice(&digest[..8]);
        Ok(ImageIdentity {
            hash: u64::from_be_bytes(head),
            identifier: hex(&digest),
        })
    }

    /// The identity of an image whose hash the client supplied (`mm_hashes`).
    pub fn from_hash(hash: u64) -> Self {
        ImageIdentity {
            hash,
            identifier: format!("{hash:016x}{:048}", 0),
        }
    }
}

/// SGLang 0.5.23's four pad values of an item (`_compute_pad_values`).
pub fn sglang_pad_values(item_hash: u64) -> [u64; 4] {
    let mut input = WIDE_PAD_DOMAIN.to_vec();
    input.extend_from_slice(&item_hash.to_be_bytes());
    let digest = sha256_of(&input);
    let mut values = [0u64; 4];
    for (k, v) in values.iter_mut().enumerate() {
        let mut word = [0u8; 8];
        word.copy_from_slice(&digest[8 * k..8 * k + 8]);
        *v = MM_PAD_BASE + (u64::from_be_bytes(word) & WIDE_PAD_MASK);
    }
    values
}

/// `padding_sequence(n)`: the four pad values cycled over `n` positions.
pub fn sglang_padding(item_hash: u64, n: usize) -> impl Iterator<Item = u64> {
    sglang_pad_values(item_hash).into_iter().cycle().take(n)
}

/// Standard base64 (RFC 4648, `+/`, optional `=` padding; ASCII whitespace ignored).
pub fn decode_base64(text: &str) -> Result<Vec<u8>, ImageError> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let mut acc = 0u32;
    let mut bits = 0u32;
    let mut padding = 0usize;
    for (position, c) in text.bytes().enumerate() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' => {
                padding += 1;
                continue;
            }
            b' ' | b'\n' | b'\r' | b'\t' => continue,
            _ => return Err(ImageError::BadBase64 { position }),
        };
        if padding > 0 {
            // Data after padding.
            return Err(ImageError::BadBase64 { position });
        }
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    if padding > 2 || bits >= 6 {
        return Err(ImageError::BadBase64 {
            position: text.len(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s5_wide_pad_values() {
        let values = sglang_pad_values(15603577931234569631);
        assert_eq!(
            values,
            [
                4347295146520627095,
                3437777575314344313,
                653167716596367843,
                1551477688476707388
            ]
        );
        let span: Vec<u64> = sglang_padding(15603577931234569631, 6).collect();
        assert_eq!(
            span,
            [values[0], values[1], values[2], values[3], values[0], values[1]]
        );
        assert!(values.iter().all(|&v| v > u64::from(u32::MAX)));
    }

    #[test]
    fn data_urls_hash_their_decoded_bytes() {
        // "hello" in base64.
        let a = ImageIdentity::from_url("data:image/png;base64,aGVsbG8=").expect("valid");
        let digest = sha256_of(b"hello");
        assert_eq!(a.identifier, hex(&digest));
        assert_eq!(a.hash, 0x2cf24dba5fb0a30e);
        assert_eq!(&a.identifier[..16], format!("{:016x}", a.hash));
        // The same bytes without padding, with a line break: same identity.
        let b = ImageIdentity::from_url("data:image/png;base64,aGVs\nbG8").expect("valid");
        assert_eq!(a, b);
        // A plain data URL hashes its text after the comma.
        let c = ImageIdentity::from_url("data:text/plain,hello").expect("valid");
        assert_eq!(c.hash, a.hash);
        // Other URLs are hashed as strings and never fetched.
        let d = ImageIdentity::from_url("https://example.invalid/cat.png").expect("valid");
        assert_eq!(
            d.identifier,
            hex(&sha256_of(b"https://example.invalid/cat.png"))
        );
    }

    #[test]
    fn bad_images_are_errors_not_panics() {
        assert_eq!(ImageIdentity::from_url(""), Err(ImageError::Empty));
        assert_eq!(
            ImageIdentity::from_url("data:image/png;base64"),
            Err(ImageError::NoComma)
        );
        assert!(matches!(
            ImageIdentity::from_url("data:image/png;base64,a*b"),
            Err(ImageError::BadBase64 { position: 1 })
        ));
        assert!(decode_base64("a").is_err());
        assert!(decode_base64("aGVsbG8=x").is_err());
        assert_eq!(decode_base64("").expect("empty is valid"), b"");
    }

    #[test]
    fn supplied_hashes_make_identifiers_that_start_with_the_hash() {
        let id = ImageIdentity::from_hash(0xdead_beef);
        assert_eq!(id.identifier.len(), 64);
        assert_eq!(
            kvroute_core::hash::mm_hash_from_identifier(&id.identifier),
            0xdead_beef
        );
    }
}
