//! The engines' own block hashes, so mocker events carry real engine hashes.
//!
//! **vLLM flavour: `sha256_cbor`.** vLLM 0.33 hashes a block as
//! `H((parent_digest or NONE_HASH, tuple(token_ids), extra_keys or None))`.
//! Its default `--prefix-caching-hash-algo sha256` applies SHA-256 to Python's
//! `pickle` of that tuple, which only Python can reproduce byte for byte; the
//! documented alternative `sha256_cbor` applies SHA-256 to the tuple's canonical
//! CBOR, which is the same structure in a portable encoding. The mocker uses
//! `sha256_cbor`: a real vLLM started with `--prefix-caching-hash-algo
//! sha256_cbor` publishes exactly these values, and a router treats engine
//! hashes as opaque anyway. `NONE_HASH = sha256(cbor("vllm-none-hash"))`
//! (`PYTHONHASHSEED` unset). The published integer is the digest's **last** 8
//! bytes, big-endian, unsigned. Vectors V3–V5 of `hash-vectors.md` test this.
//!
//! **SGLang flavour: page digest chain.** `sha256(prior_digest? ‖ page_bytes)`
//! with the page's ids as little-endian `u32`, or, when any id exceeds
//! `u32::MAX` (a *wide page*, multimodal pad ids in 0.5.23), a `0xff` tag byte
//! followed by the ids as little-endian `u64`. The published integer is the
//! digest's **first** 8 bytes, big-endian, **signed**. Vectors S1–S3.
//!
//! **TensorRT-LLM flavour: V2 radix block keys** (`kv_cache_manager_v2/_cache_key.py`
//! of NVIDIA/TensorRT-LLM at commit 13599e9). The chain starts at
//! `SHA-256(reuse scope)`: one mask byte (bit 0 LoRA, bit 1 salt) and an
//! 8-byte little-endian value per field set; a block's key is
//! `SHA-256(parent key ‖ each token as 8 little-endian bytes)`, an image's
//! first position contributing its 32-byte digest instead. The published
//! integer (`StreamingEventSink::wireHash`) is the key's **first** 8 bytes,
//! big-endian, **signed**.

use sha2::{Digest, Sha256};

/// A SHA-256 digest: the engine's full block hash, kept to chain the next block.
pub type Digest32 = [u8; 32];

/// The string vLLM hashes into `NONE_HASH` when `PYTHONHASHSEED` is unset.
pub const VLLM_NONE_HASH_SEED: &str = "vllm-none-hash";

/// One item of a vLLM block's hash-side extra keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VllmHashKey {
    /// `("mm", identifier, offset)`: a multimodal item overlapping the block;
    /// `offset` = item start − block start (negative when the item began earlier).
    Mm {
        /// The item's identifier (a hex digest).
        identifier: String,
        /// Item start relative to the block start.
        offset: i64,
    },
    /// `("lora", name, path)`: the adapter the block was computed with (the
    /// mock's adapters have no path of their own: the name stands for it).
    Lora {
        /// The adapter's name.
        name: String,
    },
}

/// A minimal canonical CBOR writer: exactly the subset `cbor2.dumps(obj,
/// canonical=True)` produces for vLLM's hash inputs.
#[derive(Debug, Default)]
struct Cbor(Vec<u8>);

impl Cbor {
    /// A major type with its argument in the shortest form.
    fn head(&mut self, major: u8, value: u64) {
        let m = major << 5;
        match value {
            0..=23 => self.0.push(m | value as u8),
            24..=0xff => self.0.extend_from_slice(&[m | 24, value as u8]),
            0x100..=0xffff => {
                self.0.push(m | 25);
                self.0.extend_from_slice(&(value as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.0.push(m | 26);
                self.0.extend_from_slice(&(value as u32).to_be_bytes());
            }
            _ => {
                self.0.push(m | 27);
                self.0.extend_from_slice(&value.to_be_bytes());
            }
        }
    }

    fn uint(&mut self, v: u64) {
        self.head(0, v);
    }

    fn int(&mut self, v: i64) {
        if v >= 0 {
            self.head(0, v as u64);
        } else {
            // CBOR negative integers carry -1 - v, which is !v for two's complement.
            self.head(1, !v as u64);
        }
    }

    fn bytes(&mut self, b: &[u8]) {
        self.head(2, b.len() as u64);
        self.0.extend_from_slice(b);
    }

    fn text(&mut self, s: &str) {
        self.head(3, s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }

    fn array(&mut self, len: usize) {
        self.head(4, len as u64);
    }

    fn null(&mut self) {
        self.0.push(0xf6);
    }
}

fn sha256(bytes: &[u8]) -> Digest32 {
    Sha256::digest(bytes).into()
}

/// vLLM's `NONE_HASH` for `sha256_cbor`: the parent digest of a sequence's first block.
pub fn vllm_none_hash() -> Digest32 {
    let mut c = Cbor::default();
    c.text(VLLM_NONE_HASH_SEED);
    sha256(&c.0)
}

/// The canonical CBOR of vLLM's hash input `(parent, tuple(tokens), extra_keys or None)`.
fn vllm_block_cbor(parent: &Digest32, tokens: &[u64], extra: &[VllmHashKey]) -> Vec<u8> {
    let mut c = Cbor(Vec::with_capacity(40 + tokens.len() * 5));
    c.array(3);
    c.bytes(parent);
    c.array(tokens.len());
    for &t in tokens {
        c.uint(t);
    }
    if extra.is_empty() {
        c.null();
    } else {
        c.array(extra.len());
        for key in extra {
            match key {
                VllmHashKey::Mm { identifier, offset } => {
                    c.array(3);
                    c.text("mm");
                    c.text(identifier);
                    c.int(*offset);
                }
                VllmHashKey::Lora { name } => {
                    c.array(3);
                    c.text("lora");
                    c.text(name);
                    c.text(name);
                }
            }
        }
    }
    c.0
}

/// One vLLM block digest (`sha256_cbor`); `parent` is the previous block's
/// digest or [`vllm_none_hash`] for the first block.
pub fn vllm_block_digest(parent: &Digest32, tokens: &[u64], extra: &[VllmHashKey]) -> Digest32 {
    sha256(&vllm_block_cbor(parent, tokens, extra))
}

/// The integer vLLM publishes for a digest: its last 8 bytes, big-endian, unsigned.
pub fn vllm_published(digest: &Digest32) -> u64 {
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(tail)
}

/// One SGLang page digest; `prior` is the previous page's digest (none for the first page).
pub fn sglang_page_digest(prior: Option<&Digest32>, tokens: &[u64]) -> Digest32 {
    let mut h = Sha256::new();
    if let Some(prior) = prior {
        h.update(prior);
    }
    if tokens.iter().any(|&t| t > u64::from(u32::MAX)) {
        h.update([0xff]);
        for &t in tokens {
            h.update(t.to_le_bytes());
        }
    } else {
        for &t in tokens {
            // Checked above: every id fits in u32.
            h.update((t as u32).to_le_bytes());
        }
    }
    h.finalize().into()
}

/// The integer SGLang publishes for a digest: its first 8 bytes, big-endian, signed.
pub fn sglang_published(digest: &Digest32) -> i64 {
    let mut head = [0u8; 8];
    head.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(head)
}

/// One TensorRT-LLM token of a radix key: an id, or an image's 32-byte digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrtllmToken<'a> {
    /// A token id (text, or an image position after the first).
    Id(u64),
    /// An image's digest, at the item's first position.
    Digest(&'a Digest32),
}

/// The root of a TensorRT-LLM key chain: the reuse scope's digest (no salt;
/// a LoRA adapter's id as the mocker numbers it, `None` without one).
pub fn trtllm_root_key(lora_id: Option<u64>) -> Digest32 {
    let mut scope = vec![u8::from(lora_id.is_some())];
    if let Some(id) = lora_id {
        scope.extend_from_slice(&id.to_le_bytes());
    }
    sha256(&scope)
}

/// One TensorRT-LLM radix block key, chained from `parent`.
pub fn trtllm_block_key(parent: &Digest32, tokens: &[TrtllmToken<'_>]) -> Digest32 {
    let mut h = Sha256::new();
    h.update(parent);
    for t in tokens {
        match t {
            TrtllmToken::Id(id) => h.update(id.to_le_bytes()),
            TrtllmToken::Digest(d) => h.update(d),
        }
    }
    h.finalize().into()
}

/// The integer TensorRT-LLM publishes for a key: its first 8 bytes, big-endian, signed.
pub fn trtllm_published(key: &Digest32) -> i64 {
    sglang_published(key)
}

/// Lowercase hex of bytes (digests in logs, vLLM multimodal identifiers).
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

/// The SHA-256 of arbitrary bytes.
pub fn sha256_of(bytes: &[u8]) -> Digest32 {
    sha256(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("test hex"))
            .collect()
    }

    #[test]
    fn v3_none_hash_cbor_and_digest() {
        let mut c = Cbor::default();
        c.text(VLLM_NONE_HASH_SEED);
        assert_eq!(hex(&c.0), "6e766c6c6d2d6e6f6e652d68617368");
        assert_eq!(
            hex(&vllm_none_hash()),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
    }

    #[test]
    fn v4_first_block_cbor_digest_and_published_int() {
        let none = vllm_none_hash();
        let cbor = vllm_block_cbor(&none, &[1, 2, 3, 4], &[]);
        assert_eq!(
            hex(&cbor),
            "8358209bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef08401020304f6"
        );
        let d = vllm_block_digest(&none, &[1, 2, 3, 4], &[]);
        assert_eq!(
            hex(&d),
            "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111"
        );
        assert_eq!(vllm_published(&d), 9561501211280363793);
    }

    #[test]
    fn v5_chained_block() {
        let d4 = vllm_block_digest(&vllm_none_hash(), &[1, 2, 3, 4], &[]);
        let cbor = vllm_block_cbor(&d4, &[5, 6, 7, 8], &[]);
        assert_eq!(
            hex(&cbor),
            "83582058d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d551118405060708f6"
        );
        let d5 = vllm_block_digest(&d4, &[5, 6, 7, 8], &[]);
        assert_eq!(
            hex(&d5),
            "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1"
        );
        assert_eq!(vllm_published(&d5), 15292913576410714033);
    }

    #[test]
    fn cbor_integers_use_the_shortest_head_and_negative_offsets() {
        let mut c = Cbor::default();
        for v in [
            0u64,
            23,
            24,
            255,
            256,
            65535,
            65536,
            u64::from(u32::MAX),
            1 << 40,
        ] {
            c.uint(v);
        }
        c.int(-1);
        c.int(-4);
        c.int(-25);
        assert_eq!(
            hex(&c.0),
            "0017181818ff19010019ffff1a000100001affffffff1b00000100000000002023\
             3818"
        );
        let key = VllmHashKey::Mm {
            identifier: "ab".into(),
            offset: -20,
        };
        let cbor = vllm_block_cbor(&[0; 32], &[151655], &[key]);
        // [token 151655] then (("mm", "ab", -20),)
        assert!(hex(&cbor).ends_with("811a000250678183626d6d62616233"));
    }

    #[test]
    fn s1_s2_text_pages() {
        let s1 = sglang_page_digest(None, &[1, 2, 3, 4]);
        assert_eq!(
            hex(&s1),
            "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
        );
        assert_eq!(sglang_published(&s1), -3488128144981237669);
        let s2 = sglang_page_digest(Some(&s1), &[5, 6, 7, 8]);
        assert_eq!(
            hex(&s2),
            "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"
        );
        assert_eq!(sglang_published(&s2), 5674439469042975057);
    }

    #[test]
    fn s3_wide_page_uses_the_ff_tag_and_u64_ids() {
        let s1 = sglang_page_digest(None, &[1, 2, 3, 4]);
        let wide = 1_000_000 + (1u64 << 61);
        assert_eq!(wide, 2305843009214693952);
        let s3 = sglang_page_digest(Some(&s1), &[wide, 6, 7, 8]);
        assert_eq!(
            hex(&s3),
            "74918a32becc6ada7434e220532bc0cb0ab4240b690b4906a22cfa461c94b81c"
        );
        assert_eq!(sglang_published(&s3), 8399646730576751322);
        let mut manual = s1.to_vec();
        manual.push(0xff);
        for t in [wide, 6, 7, 8] {
            manual.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(sha256_of(&manual), s3);
    }

    #[test]
    fn unhex_roundtrip_helper() {
        assert_eq!(hex(&unhex("00ff10")), "00ff10");
    }
}
