//! Images in prompts: their identity, and the tokens each engine puts in their place.
//!
//! The rules live in [`kvroute_core::multimodal`], shared with the router's
//! request side so both compute identical ids and hashes; this module
//! re-exports them for the engine. In short:
//!
//! * **Identity**: the client's `mm_hashes` entry when given; otherwise the
//!   first 8 bytes (big-endian) of SHA-256 over the image bytes of a `data:`
//!   URL, or over the URL string for any other URL (nothing is fetched).
//! * **SGLang 0.5.23**: the image's `--mm-tokens-per-image` positions hold the
//!   item's four wide pad values cycled (vector S5).
//! * **vLLM 0.33**: the positions hold the placeholder id (151655) and the
//!   image is named in each overlapping block's `extra_keys` as
//!   `[identifier, item start − block start]`.
//!
//! Both engines keep the vision start (151652) and end (151653) ids around the span.

pub use kvroute_core::multimodal::{
    decode_base64, sglang_pad_values, sglang_padding, ImageError, ImageIdentity, ImageSpan,
    ImageTokenRule, MM_PAD_BASE, WIDE_PAD_DOMAIN, WIDE_PAD_MASK,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{hex, sha256_of};

    #[test]
    fn the_engine_and_the_router_share_one_identity_rule() {
        let a = ImageIdentity::from_url("data:image/png;base64,aGVsbG8=").expect("valid");
        assert_eq!(a.identifier, hex(&sha256_of(b"hello")));
        assert_eq!(a.hash, 0x2cf24dba5fb0a30e);
        assert_eq!(
            sglang_pad_values(15603577931234569631)[0],
            4347295146520627095
        );
    }
}
