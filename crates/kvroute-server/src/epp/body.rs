//! Bodies through the picker, cut into the pieces they go back to Envoy in
//! (a request body is gathered under the same rules as over HTTP:
//! [`crate::bodies::Gathering`]).
//!
//! In `FULL_DUPLEX_STREAMED` mode whatever the picker does not send back
//! does not reach the upstream, so every byte of a body is echoed, in
//! `streamed_response` pieces of at most [`CHUNK_BYTES`] (GIE's and
//! Dynamo's limit, which keeps each message under Envoy's 64 KiB
//! recommendation), the last one with `end_of_stream`. An empty body still
//! goes back as one empty piece, so that the end reaches the upstream.

use envoy_types::pb::envoy::service::ext_proc::v3::StreamedBodyResponse;

/// The largest piece of a body sent back in one message.
pub const CHUNK_BYTES: usize = 62_000;

/// `body` cut into pieces of at most [`CHUNK_BYTES`], in order; the last
/// carries `end_of_stream`. An empty body is one empty piece.
pub fn pieces(body: &[u8], end_of_stream: bool) -> Vec<StreamedBodyResponse> {
    if body.is_empty() {
        return vec![StreamedBodyResponse {
            body: Vec::new(),
            end_of_stream,
            ..StreamedBodyResponse::default()
        }];
    }
    let count = body.len().div_ceil(CHUNK_BYTES);
    body.chunks(CHUNK_BYTES)
        .enumerate()
        .map(|(i, piece)| StreamedBodyResponse {
            body: piece.to_vec(),
            end_of_stream: end_of_stream && i + 1 == count,
            ..StreamedBodyResponse::default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_goes_back_in_pieces_of_at_most_62_000_bytes_the_last_ending_it() {
        // GIE's and Dynamo's number, written out: not whatever the constant says.
        assert_eq!(CHUNK_BYTES, 62_000);
        for len in [1usize, 61_999, 62_000, 62_001, 124_000, 124_001, 200_000] {
            let body: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let got = pieces(&body, true);
            assert_eq!(got.len(), len.div_ceil(CHUNK_BYTES), "{len}");
            assert!(got
                .iter()
                .all(|p| !p.body.is_empty() && p.body.len() <= CHUNK_BYTES));
            let ends: Vec<bool> = got.iter().map(|p| p.end_of_stream).collect();
            assert_eq!(ends.iter().filter(|e| **e).count(), 1, "{len}");
            assert_eq!(ends.last(), Some(&true));
            let joined: Vec<u8> = got.into_iter().flat_map(|p| p.body).collect();
            assert_eq!(joined, body, "byte for byte");
        }
    }

    #[test]
    fn an_empty_body_is_one_empty_piece_and_a_middle_piece_ends_nothing() {
        let empty = pieces(b"", true);
        assert_eq!(empty.len(), 1);
        assert!(empty[0].body.is_empty() && empty[0].end_of_stream);
        let middle = pieces(&[7; 70_000], false);
        assert_eq!(middle.len(), 2);
        assert!(middle.iter().all(|p| !p.end_of_stream));
    }
}
