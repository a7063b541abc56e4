//! Free TCP ports on 127.0.0.1 for the publishers' sockets, below the
//! kernel's ephemeral range (32 768 and up) so that no outgoing connection
//! takes one between the check and the bind.

use std::net::TcpListener;

use crate::error::{Error, Result};

/// The first port above the ones handed out.
pub const PORT_LIMIT: u32 = 32_768;

/// Whether `port` can be bound on 127.0.0.1 now.
fn is_free(port: u32) -> bool {
    u16::try_from(port).is_ok_and(|p| TcpListener::bind(("127.0.0.1", p)).is_ok())
}

/// For each of `workers` workers, an events base port E and a replay base
/// port R such that E..E+dp and R..R+dp are all free (R = E + dp), from
/// `start` up; an error when they do not fit below [`PORT_LIMIT`].
pub fn allocate(workers: u32, dp: u32, start: u16) -> Result<Vec<(u16, u16)>> {
    let mut out = Vec::new();
    let mut next = u32::from(start);
    while out.len() < workers as usize {
        if next + 2 * dp > PORT_LIMIT {
            return Err(Error::Invalid(format!(
                "{workers} workers × dp {dp} need {} free ports between {start} and {PORT_LIMIT}; \
                 found room for {} workers",
                2 * workers * dp,
                out.len()
            )));
        }
        match (next..next + 2 * dp).find(|&p| !is_free(p)) {
            Some(taken) => next = taken + 1,
            None => {
                // Both fit in u16: next + 2·dp ≤ PORT_LIMIT.
                let events = next as u16;
                out.push((events, (next + dp) as u16));
                next += 2 * dp;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_disjoint_free_and_skip_a_taken_port() {
        let first = allocate(1, 2, 25_000).expect("free ports")[0].0;
        let taken = TcpListener::bind(("127.0.0.1", first + 1));
        let blocks = allocate(3, 2, first).expect("free ports");
        assert_eq!(blocks.len(), 3);
        if taken.is_ok() {
            assert!(blocks[0].0 > first + 1, "{blocks:?}");
        }
        for w in blocks.windows(2) {
            assert!(w[0].1 + 2 <= w[1].0);
        }
        for &(e, r) in &blocks {
            assert_eq!(r, e + 2);
        }
        assert!(allocate(1, 10, 32_760).is_err());
    }
}
