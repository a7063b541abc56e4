//! Reading a worker's answer with a bound on what is held: an answer the
//! router must read whole (a prefill leg's `kv_transfer_params`, a merged
//! answer) is read up to `--max-answer-mib` and refused past it; a
//! non-streamed answer for a client is read whole only up to the bound and
//! otherwise passed on as it comes; an answer nobody reads is drained chunk
//! by chunk. A worker that answers gigabytes costs the router a bounded
//! buffer, never its memory.

use axum::body::Bytes;

/// A worker's answer read up to a bound.
#[derive(Debug)]
pub enum UpTo {
    /// The whole answer, within the bound.
    Whole(Bytes),
    /// The answer is longer: what was read, and the rest still to come.
    Over(Bytes, reqwest::Response),
}

/// Why an answer read whole was not.
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    /// It is longer than the bound.
    #[error("the answer is over the {cap} bytes the router reads whole (--max-answer-mib)")]
    TooLarge {
        /// The bound.
        cap: usize,
    },
    /// It could not be read to its end.
    #[error(transparent)]
    Read(#[from] reqwest::Error),
}

/// Reads `resp` whole if it is at most `cap` bytes; else returns what was
/// read with the rest of the answer. A `Content-Length` over `cap` is taken
/// at its word without reading.
pub async fn read_up_to(mut resp: reqwest::Response, cap: usize) -> Result<UpTo, reqwest::Error> {
    if resp.content_length().is_some_and(|n| n > cap as u64) {
        return Ok(UpTo::Over(Bytes::new(), resp));
    }
    let mut read = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        read.extend_from_slice(&chunk);
        if read.len() > cap {
            return Ok(UpTo::Over(Bytes::from(read), resp));
        }
    }
    Ok(UpTo::Whole(Bytes::from(read)))
}

/// Reads `resp` whole, refusing it past `cap` bytes.
pub async fn read_capped(resp: reqwest::Response, cap: usize) -> Result<Bytes, AnswerError> {
    match read_up_to(resp, cap).await? {
        UpTo::Whole(bytes) => Ok(bytes),
        UpTo::Over(..) => Err(AnswerError::TooLarge { cap }),
    }
}

/// Reads `resp` to its end, keeping nothing.
pub async fn drain(mut resp: reqwest::Response) -> Result<(), reqwest::Error> {
    while resp.chunk().await?.is_some() {}
    Ok(())
}
