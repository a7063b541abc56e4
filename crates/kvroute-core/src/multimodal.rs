//! Images in prompts: their identity, the tokens each engine flavour puts in
//! their place, and the local block hashes of a prompt that holds them.
//!
//! This module is the one copy of these rules; the mock engine and the
//! router's request side both use it, and the wire decoder's side of the same
//! rules lives in [`crate::tokens`] (the fold) and [`crate::hash`] (item hashes).
//!
//! * **Identity** of an image: the client's hash when it gives one (SGLang's
//!   `mm_hashes` field, one entry per image in order); otherwise the first 8
//!   bytes (big-endian) of SHA-256 over the image bytes of a `data:` URL
//!   (base64-decoded when the header ends in `;base64`, else the raw text after
//!   the comma). Any other URL is hashed as its string and never fetched.
//! * **SGLang 0.5.23**: the image's span holds the item's four wide pad values
//!   cycled (`v0 v1 v2 v3 v0 …`), with
//!   `digest = sha256("sglang-mm-wide-pad-v1" ‖ BE8(identity))` and
//!   `v_k = 1_000_000 + (BE8(digest[8k..8k+8]) & (2^62 − 1))` (vector S5).
//!   Events carry those ~62-bit ids; both sides fold them with
//!   [`fold_token_id`], so a prompt's blocks hash like the event's.
//! * **vLLM 0.33**: the span holds the model's placeholder id repeated, and
//!   each block that overlaps the span names the item in its `extra_keys` as
//!   `[identifier, item start − block start]`. For a `data:` URL image of a
//!   model whose engine-side name (`root`, vLLM's `--model`) is known, the
//!   identifier is vLLM's own: [`vllm_image_identifier`], BLAKE3 over the
//!   encoded bytes and that name. Otherwise it is a 64-hex digest whose first
//!   16 hex digits are the identity (the full SHA-256 of the image bytes or
//!   URL, or the client's hash followed by 48 zeros). A client's `uuid` on
//!   the content part is the identifier as given. Its item hash is
//!   [`mm_hash_from_identifier`], exactly as the decoder computes it.
//! * **TensorRT-LLM** (streaming KV events): the engine lays an image out
//!   digest-first (its digest, then ids above the vocabulary) and names it
//!   in each overlapping block's `mm_keys`; the decoder rewrites image
//!   position k to [`trtllm_image_token`]`(k)` and the request side lays the
//!   span out the same way, so neither needs the engine's vocabulary size.
//! * **Span length**: [`ImageTokenRule`], today a fixed count per deployment.

use sha2::{Digest, Sha256};

use crate::event::WorkerFlavor;

use crate::hash::{
    local_block_hash_with_mm, local_block_hashes, mm_hash_from_identifier, LocalBlockHash,
};
use crate::tokens::fold_token_id;

/// Offset of every multimodal pad value (`MM_PAD_SHIFT_VALUE`), as a 64-bit id.
pub const MM_PAD_BASE: u64 = crate::tokens::MM_PAD_BASE as u64;
/// Mask of the 62-bit digest slice in an SGLang 0.5.23 wide pad value.
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
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageIdentity {
    /// The 64-bit item hash (SGLang's pad seed; the first 16 hex digits of `identifier`).
    pub hash: u64,
    /// vLLM's `mm_identifier`: 64 lowercase hex digits.
    pub identifier: String,
}

impl ImageIdentity {
    /// The identity of an image given by URL (data URLs are decoded, others
    /// hashed as text), with no engine-side model name: SHA-256 throughout.
    pub fn from_url(url: &str) -> Result<Self, ImageError> {
        ImageIdentity::from_url_for(url, None)
    }

    /// The identity of an image given by URL for a model the engine loaded
    /// from `model_id` (its `/v1/models` `root`): a `data:` URL's
    /// identifier is then vLLM's ([`vllm_image_identifier`]); the 64-bit
    /// hash (SGLang's pad seed) is SHA-256's either way. A URL that is not a
    /// `data:` URL is hashed as its text (the engine fetches and hashes its
    /// bytes, which the router never does).
    pub fn from_url_for(url: &str, model_id: Option<&str>) -> Result<Self, ImageError> {
        if url.is_empty() {
            return Err(ImageError::Empty);
        }
        let Some(rest) = url.strip_prefix("data:") else {
            return Ok(ImageIdentity::of_digest(sha256(url.as_bytes())));
        };
        let (header, data) = rest.split_once(',').ok_or(ImageError::NoComma)?;
        let bytes = if header.ends_with(";base64") {
            std::borrow::Cow::Owned(decode_base64(data)?)
        } else {
            std::borrow::Cow::Borrowed(data.as_bytes())
        };
        let mut identity = ImageIdentity::of_digest(sha256(&bytes));
        if let Some(model_id) = model_id {
            identity.identifier = vllm_image_identifier(&bytes, model_id);
        }
        Ok(identity)
    }

    fn of_digest(digest: [u8; 32]) -> Self {
        ImageIdentity {
            hash: be_u64(&digest[..8]),
            identifier: hex(&digest),
        }
    }

    /// The identity of an image the client named with a `uuid` on its
    /// content part: vLLM keys the item by the uuid itself.
    pub fn from_uuid(uuid: &str) -> Self {
        ImageIdentity {
            hash: mm_hash_from_identifier(uuid),
            identifier: uuid.to_owned(),
        }
    }

    /// The identity of an image whose hash the client supplied (`mm_hashes`).
    pub fn from_hash(hash: u64) -> Self {
        ImageIdentity {
            hash,
            identifier: format!("{hash:016x}{:048}", 0),
        }
    }

    /// The identity rule in one call: the client's hash when given, else the
    /// URL's ([`ImageIdentity::from_url_for`] with `model_id`).
    pub fn resolve(
        client_hash: Option<u64>,
        url: &str,
        model_id: Option<&str>,
    ) -> Result<Self, ImageError> {
        match client_hash {
            Some(hash) => Ok(ImageIdentity::from_hash(hash)),
            None => ImageIdentity::from_url_for(url, model_id),
        }
    }

    /// The item hash a vLLM block's extra key contributes to its local hash;
    /// the decoder's rule ([`mm_hash_from_identifier`]) applied to the identifier.
    pub fn vllm_mm_hash(&self) -> u64 {
        mm_hash_from_identifier(&self.identifier)
    }

    /// SGLang 0.5.23's four pad values of this item.
    pub fn sglang_pad_values(&self) -> [u64; 4] {
        sglang_pad_values(self.hash)
    }
}

/// vLLM's identifier of an image given as encoded bytes (a `data:` URL's),
/// served by an engine that loaded its model from `model_id`: the hex
/// BLAKE3 digest of vLLM's framed serialization of the item's fields in
/// key order, `image` (its type name, then the bytes) and `model_id`: each
/// key, type name and value framed as `len as u64 LE ‖ bytes`, each key and
/// type name followed by the tag byte 3 (`vllm/multimodal/hasher.py`; checked
/// against it by the vector in `tests/data/vllm_image_hash.json`). This is
/// vLLM's default `--mm-hash-algorithm` with no processor or media kwargs.
pub fn vllm_image_identifier(bytes: &[u8], model_id: &str) -> String {
    /// The tag vLLM's hasher writes after a key or a type name.
    const LEAF: &[u8] = &[3];
    fn framed(h: &mut blake3::Hasher, part: &[u8]) {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    let mut h = blake3::Hasher::new();
    framed(&mut h, b"image");
    h.update(LEAF);
    framed(&mut h, b"image");
    h.update(LEAF);
    framed(&mut h, bytes);
    framed(&mut h, b"model_id");
    h.update(LEAF);
    framed(&mut h, model_id.as_bytes());
    hex(h.finalize().as_bytes())
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

fn be_u64(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(word)
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

/// SGLang 0.5.23's four pad values of an item (`_compute_pad_values`).
pub fn sglang_pad_values(item_hash: u64) -> [u64; 4] {
    let mut h = Sha256::new();
    h.update(WIDE_PAD_DOMAIN);
    h.update(item_hash.to_be_bytes());
    let digest: [u8; 32] = h.finalize().into();
    std::array::from_fn(|k| MM_PAD_BASE + (be_u64(&digest[8 * k..8 * k + 8]) & WIDE_PAD_MASK))
}

/// `padding_sequence(n)`: the four pad values cycled over `n` positions.
pub fn sglang_padding(item_hash: u64, n: usize) -> impl Iterator<Item = u64> {
    sglang_pad_values(item_hash).into_iter().cycle().take(n)
}

/// Standard base64 (RFC 4648, `+/` or URL-safe `-_`, optional `=` padding;
/// ASCII whitespace ignored).
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

/// How many prompt positions an image takes.
///
/// Today one fixed count per deployment (`--mm-tokens-per-image`, default 64,
/// the same setting in `kvroute mocker` and `kvroute serve`). This is the hook
/// for per-model rules: a model whose processor derives the count from the
/// image (e.g. Qwen2-VL's patch grid) gets a variant here, and every caller
/// (engine simulation and router) picks it up through [`ImageTokenRule::tokens_for`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageTokenRule {
    /// Positions per image.
    pub fixed: usize,
}

impl ImageTokenRule {
    /// The default count, 64 positions per image.
    pub const DEFAULT_TOKENS_PER_IMAGE: usize = 64;

    /// A rule giving every image of every model `n` positions.
    pub const fn fixed(n: usize) -> Self {
        ImageTokenRule { fixed: n }
    }

    /// The span of one image of `model` (the model is unused by the fixed rule).
    pub fn tokens_for(&self, _model: Option<&str>, _image: &ImageIdentity) -> usize {
        self.fixed
    }
}

impl Default for ImageTokenRule {
    fn default() -> Self {
        ImageTokenRule::fixed(Self::DEFAULT_TOKENS_PER_IMAGE)
    }
}

/// Where one image sits in a prompt, and which image it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSpan {
    /// Index of the span's first position.
    pub start: usize,
    /// Positions in the span.
    pub len: usize,
    /// The image.
    pub identity: ImageIdentity,
}

impl ImageSpan {
    /// Whether the span overlaps positions `lo..hi` (the engines' rule for
    /// which blocks name an item).
    pub fn overlaps(&self, lo: usize, hi: usize) -> bool {
        self.start < hi && self.start + self.len > lo
    }
}

/// A prompt as the router hashes it: folded token ids laid out the flavour-
/// neutral way (the placeholder id in every image position) and the images.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutingPrompt {
    /// Folded token ids; image positions hold the placeholder id.
    pub tokens: Vec<u32>,
    /// The images, in prompt order, with non-overlapping spans inside `tokens`.
    pub images: Vec<ImageSpan>,
}

/// The local block hashes a worker of `flavor` publishes for a prompt of
/// `tokens` (folded, placeholders in image positions) holding `images`.
///
/// * SGLang: every image position holds `fold_token_id` of the item's cycled
///   wide pad value; blocks hash as plain token blocks.
/// * vLLM: the tokens as given; every block overlapping an image appends that
///   item's [`ImageIdentity::vllm_mm_hash`] (sorted, Dynamo's legacy form).
/// * TensorRT-LLM: image position k (from 0 at the span's start) holds
///   [`trtllm_image_token`]`(k)`, the form the decoder gives TensorRT-LLM's
///   digest-first positions; every overlapping block appends the item's hash
///   as for vLLM.
///
/// Spans reaching past the tokens are clipped. Without images every flavour
/// gives [`local_block_hashes`] of the tokens.
pub fn prompt_local_hashes(
    tokens: &[u32],
    images: &[ImageSpan],
    flavor: WorkerFlavor,
    block_size: usize,
    seed: u64,
) -> Vec<LocalBlockHash> {
    if images.is_empty() || block_size == 0 {
        return local_block_hashes(tokens, block_size, seed, 0);
    }
    match flavor {
        WorkerFlavor::Sglang => {
            let mut laid_out = tokens.to_vec();
            for image in images {
                let end = image.start.saturating_add(image.len).min(laid_out.len());
                let Some(span) = laid_out.get_mut(image.start..end) else {
                    continue;
                };
                for (slot, pad) in span
                    .iter_mut()
                    .zip(sglang_padding(image.identity.hash, end))
                {
                    *slot = fold_token_id(pad);
                }
            }
            local_block_hashes(&laid_out, block_size, seed, 0)
        }
        WorkerFlavor::Vllm => blocks_with_items(tokens, images, block_size, seed),
        WorkerFlavor::Trtllm => {
            let mut laid_out = tokens.to_vec();
            for image in images {
                let end = image.start.saturating_add(image.len).min(laid_out.len());
                if let Some(span) = laid_out.get_mut(image.start..end) {
                    for (k, slot) in span.iter_mut().enumerate() {
                        *slot = trtllm_image_token(k);
                    }
                }
            }
            blocks_with_items(&laid_out, images, block_size, seed)
        }
    }
}

/// The token TensorRT-LLM's item-local image position `k` is hashed as, on
/// the request side and by the decoder: `1_000_000 + k` (k below 2^30).
pub fn trtllm_image_token(k: usize) -> u32 {
    crate::tokens::pad_value_for_mm_hash(k as u64)
}

/// Blocks of `tokens`, each followed by the item hashes of the images it overlaps.
fn blocks_with_items(
    tokens: &[u32],
    images: &[ImageSpan],
    block_size: usize,
    seed: u64,
) -> Vec<LocalBlockHash> {
    let items: Vec<u64> = images.iter().map(|i| i.identity.vllm_mm_hash()).collect();
    let mut block_items = Vec::new();
    tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(b, block)| {
            let (lo, hi) = (b * block_size, (b + 1) * block_size);
            block_items.clear();
            block_items.extend(
                images
                    .iter()
                    .zip(&items)
                    .filter(|(image, _)| image.overlaps(lo, hi))
                    .map(|(_, &h)| h),
            );
            local_block_hash_with_mm(block, &block_items, seed)
        })
        .collect()
}

impl RoutingPrompt {
    /// [`prompt_local_hashes`] of this prompt.
    pub fn local_hashes(
        &self,
        flavor: WorkerFlavor,
        block_size: usize,
        seed: u64,
    ) -> Vec<LocalBlockHash> {
        prompt_local_hashes(&self.tokens, &self.images, flavor, block_size, seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{local_block_hash, HASH_SEED};

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
        assert_eq!(a.identifier, hex(&sha256(b"hello")));
        assert_eq!(a.hash, 0x2cf24dba5fb0a30e);
        assert_eq!(&a.identifier[..16], format!("{:016x}", a.hash));
        assert_eq!(a.vllm_mm_hash(), a.hash);
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
            hex(&sha256(b"https://example.invalid/cat.png"))
        );
        // A client hash wins over the URL.
        let e = ImageIdentity::resolve(Some(7), "https://example.invalid/cat.png", Some("m"))
            .expect("ok");
        assert_eq!((e.hash, e.vllm_mm_hash()), (7, 7));
        assert_eq!(
            ImageIdentity::resolve(None, "data:text/plain,hello", None),
            Ok(c)
        );
    }

    #[test]
    fn a_vllm_model_names_a_data_url_image_by_blake3_of_its_bytes_and_the_model() {
        let url = "data:image/png;base64,aGVsbG8=";
        let a = ImageIdentity::from_url_for(url, Some("/models/tiny-vl")).expect("valid");
        // The framing of vLLM's hasher, computed independently (Python's blake3).
        assert_eq!(
            a.identifier,
            "981209f5d7e4b49464df9125dfa3981b62854d0d5e4f7c9b81c83a61ca0c9697"
        );
        assert_eq!(a.vllm_mm_hash(), 0x981209f5d7e4b494);
        // SGLang's seed is the bytes' either way.
        assert_eq!(a.hash, ImageIdentity::from_url(url).expect("valid").hash);
        // Another model folder, another identifier.
        let b = ImageIdentity::from_url_for(url, Some("/models/other")).expect("valid");
        assert_ne!(a.identifier, b.identifier);
        // A URL the router never fetches is named by its text.
        let web = "https://example.invalid/cat.png";
        assert_eq!(
            ImageIdentity::from_url_for(web, Some("/m")),
            ImageIdentity::from_url(web)
        );
        // A client's uuid is the identifier as given.
        let u = ImageIdentity::from_uuid("my-image-1");
        assert_eq!(u.identifier, "my-image-1");
        assert_eq!(u.vllm_mm_hash(), mm_hash_from_identifier("my-image-1"));
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
        assert_eq!(mm_hash_from_identifier(&id.identifier), 0xdead_beef);
    }

    #[test]
    fn flavors_parse_and_print() {
        assert_eq!("sglang".parse(), Ok(WorkerFlavor::Sglang));
        assert_eq!("vllm".parse(), Ok(WorkerFlavor::Vllm));
        assert_eq!("trtllm".parse(), Ok(WorkerFlavor::Trtllm));
        assert!("tensorrt".parse::<WorkerFlavor>().is_err());
        assert_eq!(WorkerFlavor::default().to_string(), "vllm");
    }

    fn prompt() -> (Vec<u32>, Vec<ImageSpan>) {
        // 4 text tokens, a 6-position image, 6 more text tokens: 16 tokens = 4 blocks of 4.
        let mut tokens: Vec<u32> = vec![1, 2, 3, 4];
        tokens.extend([9; 6]);
        tokens.extend(10..16);
        let image = ImageSpan {
            start: 4,
            len: 6,
            identity: ImageIdentity::from_hash(15603577931234569631),
        };
        (tokens, vec![image])
    }

    #[test]
    fn sglang_hashes_fold_the_cycled_pads_into_the_span() {
        let (tokens, images) = prompt();
        let got = prompt_local_hashes(&tokens, &images, WorkerFlavor::Sglang, 4, HASH_SEED);
        let p = sglang_pad_values(15603577931234569631).map(fold_token_id);
        let expected = [
            local_block_hash(&[1, 2, 3, 4], HASH_SEED),
            local_block_hash(&[p[0], p[1], p[2], p[3]], HASH_SEED),
            local_block_hash(&[p[0], p[1], 10, 11], HASH_SEED),
            local_block_hash(&[12, 13, 14, 15], HASH_SEED),
        ];
        assert_eq!(got, expected);
    }

    #[test]
    fn vllm_hashes_append_the_item_to_each_overlapping_block() {
        let (tokens, images) = prompt();
        let got = prompt_local_hashes(&tokens, &images, WorkerFlavor::Vllm, 4, HASH_SEED);
        let item = [15603577931234569631u64];
        let expected = [
            local_block_hash(&[1, 2, 3, 4], HASH_SEED),
            local_block_hash_with_mm(&[9, 9, 9, 9], &item, HASH_SEED),
            local_block_hash_with_mm(&[9, 9, 10, 11], &item, HASH_SEED),
            local_block_hash(&[12, 13, 14, 15], HASH_SEED),
        ];
        assert_eq!(got, expected);
        // Without images both flavours are plain token blocks.
        let plain = local_block_hashes(&tokens, 4, HASH_SEED, 0);
        assert_eq!(
            prompt_local_hashes(&tokens, &[], WorkerFlavor::Sglang, 4, HASH_SEED),
            plain
        );
        assert_eq!(
            RoutingPrompt {
                tokens: tokens.clone(),
                images: Vec::new()
            }
            .local_hashes(WorkerFlavor::Vllm, 4, HASH_SEED),
            plain
        );
    }

    #[test]
    fn spans_past_the_end_are_clipped_not_a_panic() {
        let tokens = vec![1, 2, 3];
        let images = vec![ImageSpan {
            start: 2,
            len: 100,
            identity: ImageIdentity::from_hash(1),
        }];
        for flavor in WorkerFlavor::ALL {
            assert_eq!(
                prompt_local_hashes(&tokens, &images, flavor, 2, HASH_SEED).len(),
                1
            );
        }
        let far = vec![ImageSpan {
            start: 50,
            len: 1,
            identity: ImageIdentity::from_hash(1),
        }];
        assert_eq!(
            prompt_local_hashes(&tokens, &far, WorkerFlavor::Sglang, 2, HASH_SEED),
            local_block_hashes(&tokens, 2, HASH_SEED, 0)
        );
    }
}
