//! Bodies through the picker: a request body gathered from its chunks up
//! to a bound, and any body cut into the pieces it goes back to Envoy in.
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

/// A request body over the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request body is over {limit} bytes")]
pub struct TooLarge {
    /// The limit, in bytes.
    pub limit: usize,
}

/// A request body as its chunks arrive, never more than its limit: the
/// buffer grows with what arrived, never by what a header announced.
#[derive(Debug, Default)]
pub struct BodyBuffer {
    bytes: Vec<u8>,
    limit: usize,
}

impl BodyBuffer {
    /// An empty body that may grow to `limit` bytes.
    pub fn new(limit: usize) -> Self {
        BodyBuffer {
            bytes: Vec::new(),
            limit,
        }
    }

    /// Appends a chunk; refuses it (keeping what came before) when the
    /// body would pass the limit.
    pub fn push(&mut self, chunk: &[u8]) -> Result<(), TooLarge> {
        if chunk.len() > self.limit.saturating_sub(self.bytes.len()) {
            return Err(TooLarge { limit: self.limit });
        }
        self.bytes.extend_from_slice(chunk);
        Ok(())
    }

    /// The bytes so far.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether nothing arrived.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The whole body, leaving the buffer empty.
    pub fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.bytes)
    }
}

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

    #[test]
    fn the_buffer_keeps_to_its_limit() {
        let mut body = BodyBuffer::new(10);
        assert_eq!(body.push(b"hello"), Ok(()));
        assert_eq!(body.push(b"world"), Ok(()));
        assert_eq!(body.push(b"!"), Err(TooLarge { limit: 10 }));
        assert_eq!(body.len(), 10);
        assert_eq!(body.take(), b"helloworld");
        assert!(body.is_empty());
        let mut none = BodyBuffer::new(0);
        assert_eq!(none.push(b""), Ok(()));
        assert_eq!(none.push(b"x"), Err(TooLarge { limit: 0 }));
    }
}
