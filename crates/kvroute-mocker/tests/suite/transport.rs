//! Live batches over a real SUB socket and complete replays over a real DEALER.

use kvroute_core::event::WorkerFlavor;
use kvroute_mocker::ReplayFrames;

use super::common::*;

fn live_then_replay(layout: ReplayFrames) {
    let mut c = config(WorkerFlavor::Vllm);
    c.replay_frames = layout;
    let fleet = TestFleet::start(c);
    let sub = subscribe(&fleet.events(0, 0));
    for i in 0..3u64 {
        let prompt: Vec<u64> = (i * 100..i * 100 + 20).collect();
        let r = post(fleet.http(0), "/v1/completions", &ids_prompt(&prompt, 2));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // Each 20-token prompt fills one block: one batch per request.
    let live = recv_n(&sub, 3);
    assert_eq!(live.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [0, 1, 2]);
    for (_, payload) in &live {
        decode_clean(payload, 16);
    }

    let all = replay(&fleet.replay(0, 0), 0, layout);
    assert_eq!(all, live, "replayed bytes equal the live bytes");
    let tail = replay(&fleet.replay(0, 0), 1, layout);
    assert_eq!(tail, live[1..]);
    assert!(
        replay(&fleet.replay(0, 0), 99, layout).is_empty(),
        "only the end marker"
    );
}

#[test]
fn sub_and_dealer_see_live_batches_and_a_four_frame_replay() {
    live_then_replay(ReplayFrames::Four);
}

#[test]
fn sub_and_dealer_see_live_batches_and_a_three_frame_replay() {
    live_then_replay(ReplayFrames::Three);
}

#[test]
fn malformed_replay_requests_are_ignored_and_later_ones_answered() {
    let fleet = TestFleet::start(config(WorkerFlavor::Sglang));
    let r = post(fleet.http(0), "/v1/completions", &ids_prompt(&[1; 20], 1));
    assert_eq!(r.status, 200);
    let ctx = zmq::Context::new();
    let dealer = ctx.socket(zmq::DEALER).expect("DEALER");
    dealer.set_rcvtimeo(300).expect("timeout");
    dealer.set_linger(0).expect("linger");
    dealer.connect(&fleet.replay(0, 0)).expect("connect");
    // No empty delimiter: the engines log "Invalid replay request" and stay
    // silent. Absence: a request is answered within milliseconds (the
    // publisher polls every 5 ms); 300 ms without an answer.
    dealer.send(&0u64.to_be_bytes()[..], 0).expect("send");
    assert!(
        dealer.recv_multipart(0).is_err(),
        "no answer to a malformed request"
    );
    let batches = replay(&fleet.replay(0, 0), 0, ReplayFrames::Four);
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].0, 0);
}

#[test]
fn each_rank_publishes_on_its_own_socket_with_its_rank_in_the_batch() {
    let mut c = config(WorkerFlavor::Sglang);
    c.dp_size = 2;
    c.workers = 2;
    let fleet = TestFleet::start(c);
    for k in 0..2 {
        assert_eq!(fleet.worker(k).events.len(), 2);
        for rank in 0..2u32 {
            let body = serde_json::json!({
                "prompt": (0..17).collect::<Vec<u64>>(),
                "max_tokens": 1,
                "data_parallel_rank": rank,
            });
            let r = post(fleet.http(k), "/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            let batches = replay(&fleet.replay(k, rank as usize), 0, ReplayFrames::Four);
            assert_eq!(batches.len(), 1, "engine {k} rank {rank}");
            assert_eq!(decode_clean(&batches[0].1, 16).dp_rank, rank);
        }
    }
    let line = fleet.worker(1).worker_arg();
    assert!(line.starts_with("name=w1,url=http://127.0.0.1:"), "{line}");
    assert!(line.ends_with(",dp=2,block_size=16"), "{line}");
}
