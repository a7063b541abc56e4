//! Token ids: the one place where ids wider than 32 bits are folded.
//!
//! Engines publish token ids as msgpack integers of any width. Text ids always
//! fit in `u32`, but SGLang 0.5.23 writes multimodal pad ids of about 62 bits
//! (`1_000_000 + 62-bit digest slice`, four per image). kvroute hashes `u32`
//! ids, so every id on every path (the event decoder, and the request side
//! including the wide pads of [`crate::multimodal`]) passes through
//! [`fold_token_id`]:
//!
//! * an id that fits in `u32` passes through unchanged, bit for bit;
//! * a wider id becomes `1_000_000 + (id & (2^30 - 1))`, a value in the image
//!   pad range, so a repeated image folds to the same ids on both sides.
//!
//! The same formula is Dynamo's `pad_value_for_mm_hash`, exposed here as
//! [`pad_value_for_mm_hash`] so that both names share one implementation.

/// First id of the image pad range (`MM_PAD_SHIFT_VALUE` in SGLang and Dynamo).
pub const MM_PAD_BASE: u32 = 1_000_000;

/// Mask applied to a wide value before it is moved into the pad range (2^30 - 1).
pub const MM_PAD_MASK: u64 = (1 << 30) - 1;

/// Maps any 64-bit value into the image pad range `[1_000_000, 1_000_000 + 2^30)`.
#[inline]
const fn into_pad_range(value: u64) -> u32 {
    // The mask keeps 30 bits, so the sum is below 2^31 and the cast is exact.
    MM_PAD_BASE + (value & MM_PAD_MASK) as u32
}

/// Folds a token id of any width into the `u32` id kvroute hashes.
///
/// Ids up to `u32::MAX` are returned unchanged; wider ids (SGLang's multimodal
/// pad values) land in the image pad range. Every token id that kvroute
/// hashes, from events or from requests, goes through this function.
#[inline]
pub const fn fold_token_id(id: u64) -> u32 {
    if id <= u32::MAX as u64 {
        id as u32
    } else {
        into_pad_range(id)
    }
}

/// The single pad value Dynamo and SGLang 0.5.10–0.5.22 derive from an item hash.
///
/// `1_000_000 + (mm_hash & (2^30 - 1))`; used when a request's image must be
/// represented by one pad id per position.
#[inline]
pub const fn pad_value_for_mm_hash(mm_hash: u64) -> u32 {
    into_pad_range(mm_hash)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ids_at_the_u32_boundary_fold_as_specified() {
        assert_eq!(fold_token_id(0), 0);
        assert_eq!(fold_token_id(u32::MAX as u64), u32::MAX);
        // u32::MAX + 1 = 2^32: its low 30 bits are zero.
        assert_eq!(fold_token_id(u32::MAX as u64 + 1), 1_000_000);
        assert_eq!(fold_token_id((1 << 62) + 1_000_000), 1_000_000 + 1_000_000);
        assert_eq!(fold_token_id(u64::MAX), 1_000_000 + (1 << 30) - 1);
    }

    #[test]
    fn pad_value_matches_vector_d10() {
        assert_eq!(pad_value_for_mm_hash(9533257059414191570), 49115154);
    }

    #[test]
    fn sglang_wide_pads_fold_into_the_pad_range() {
        // The four pad values of vector S5.
        let pads = [
            4347295146520627095u64,
            3437777575314344313,
            653167716596367843,
            1551477688476707388,
        ];
        for pad in pads {
            let folded = fold_token_id(pad);
            assert!((MM_PAD_BASE..MM_PAD_BASE + (1 << 30)).contains(&folded));
            assert_eq!(folded, pad_value_for_mm_hash(pad));
        }
    }

    proptest! {
        #[test]
        fn u32_ids_pass_through_unchanged(id: u32) {
            prop_assert_eq!(fold_token_id(id as u64), id);
        }

        #[test]
        fn wide_ids_land_in_the_pad_range(id in (u32::MAX as u64 + 1)..=u64::MAX) {
            let folded = fold_token_id(id);
            prop_assert!((MM_PAD_BASE..MM_PAD_BASE + (1 << 30)).contains(&folded));
            prop_assert_eq!(folded, pad_value_for_mm_hash(id));
        }
    }
}
