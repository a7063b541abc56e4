//! The ZeroMQ message layouts engines use for live events and replay
//! replies, read into (sequence number, payload).

use kvroute_core::cursor::MAX_SEQ;

/// The replay end marker's sequence number (`-1` as 8 big-endian bytes).
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// `[topic, seq (8 bytes BE), payload]` with a sequence number an engine
/// can publish (at most [`MAX_SEQ`]; `u64::MAX` is the replay's end marker).
pub fn split_live(mut frames: Vec<Vec<u8>>) -> Option<(u64, Vec<u8>)> {
    if frames.len() != 3 {
        return None;
    }
    let payload = frames.pop()?;
    let seq = <[u8; 8]>::try_from(frames.pop()?.as_slice()).ok()?;
    let seq = u64::from_be_bytes(seq);
    (seq <= MAX_SEQ).then_some((seq, payload))
}

/// One reply of an engine's replay socket.
#[derive(Debug, PartialEq, Eq)]
pub enum Replayed {
    /// A batch from the ring.
    Batch(u64, Vec<u8>),
    /// Nothing more follows for this request.
    End,
}

/// A replay reply as the shared ROUTER receives it: `[peer id, "", topic,
/// seq, payload]` (vLLM ≥ 0.26, SGLang ≥ 0.5.22) or `[peer id, "", seq,
/// payload]` (older); seq −1 ends it. Returns the peer id and the reply.
pub fn split_replay(mut frames: Vec<Vec<u8>>) -> Option<(Vec<u8>, Replayed)> {
    if !(4..=5).contains(&frames.len()) || !frames[1].is_empty() {
        return None;
    }
    let payload = frames.pop()?;
    let seq = <[u8; 8]>::try_from(frames.pop()?.as_slice()).ok()?;
    let peer = frames.swap_remove(0);
    if seq == END_SEQ {
        return Some((peer, Replayed::End));
    }
    Some((peer, Replayed::Batch(u64::from_be_bytes(seq), payload)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_frames_need_three_parts_and_an_eight_byte_seq() {
        assert_eq!(
            split_live(vec![vec![], 7u64.to_be_bytes().to_vec(), vec![1]]),
            Some((7, vec![1]))
        );
        assert_eq!(split_live(vec![vec![], vec![1, 2], vec![1]]), None);
        assert_eq!(split_live(vec![vec![], vec![0xff; 8], vec![1]]), None);
        assert_eq!(split_live(vec![vec![], 7u64.to_be_bytes().to_vec()]), None);
    }

    #[test]
    fn replay_replies_are_read_in_both_layouts() {
        let seq = 5u64.to_be_bytes().to_vec();
        let id = b"r1".to_vec();
        assert_eq!(
            split_replay(vec![
                id.clone(),
                vec![],
                b"t".to_vec(),
                seq.clone(),
                vec![9]
            ]),
            Some((id.clone(), Replayed::Batch(5, vec![9])))
        );
        assert_eq!(
            split_replay(vec![id.clone(), vec![], seq, vec![9]]),
            Some((id.clone(), Replayed::Batch(5, vec![9])))
        );
        assert_eq!(
            split_replay(vec![id.clone(), vec![], vec![], END_SEQ.to_vec(), vec![]]),
            Some((id.clone(), Replayed::End))
        );
        assert_eq!(
            split_replay(vec![id.clone(), vec![], END_SEQ.to_vec(), vec![]]),
            Some((id.clone(), Replayed::End))
        );
        assert!(split_replay(vec![id.clone(), vec![1], END_SEQ.to_vec(), vec![]]).is_none());
        assert!(split_replay(vec![id, vec![], vec![1, 2], vec![]]).is_none());
    }
}
