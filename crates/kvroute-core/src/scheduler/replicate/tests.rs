use super::*;
use crate::event::WorkerFlavor;
use crate::scheduler::fetch::FetchReason;
use crate::scheduler::Candidate;

fn rank(i: usize, cached: u32) -> Scored {
    Scored {
        worker: i,
        key: WorkerRank::new(i as u32, 0),
        block_size: 16,
        flavor: WorkerFlavor::Vllm,
        speed: 1.0,
        candidate: Candidate {
            device_blocks: cached,
            ..Candidate::default()
        },
        cost: Default::default(),
        overloaded: false,
    }
}

/// A fetch of `blocks` from rank 0 to rank `to`.
fn fetch(to: usize, blocks: u32) -> Fetch {
    Fetch {
        receiver: to,
        source: 0,
        source_key: WorkerRank::new(0, 0),
        source_blocks: blocks,
        blocks,
        cost: 1.0,
        instead: 2.0,
        reason: FetchReason::HolderBusy,
    }
}

fn config(hot_for_ms: u64, budget_blocks: u64) -> ReplicaConfig {
    ReplicaConfig {
        hot_for_ms,
        budget_blocks,
    }
}

#[test]
fn a_prefix_saturated_past_the_bound_is_copied_once() {
    let mut r = Replicator::new(config(1_000, 256));
    let scored = [rank(0, 100), rank(1, 0)];
    let f = fetch(1, 100);
    assert_eq!(r.observe(7, &scored, Some(&f), 0), None, "hot from now");
    assert_eq!(r.observe(7, &scored, Some(&f), 999), None, "not yet");
    let copy = r.observe(7, &scored, Some(&f), 1_000).expect("a copy");
    assert_eq!((copy.source, copy.target, copy.blocks), (0, 1, 100));
    assert_eq!(r.spent(scored[1].key), 100);
    // The clock starts again: no second copy at once.
    assert_eq!(r.observe(7, &scored, Some(&f), 1_001), None);
}

#[test]
fn a_cool_request_resets_the_clock() {
    let mut r = Replicator::new(config(1_000, 256));
    let scored = [rank(0, 100), rank(1, 0)];
    let f = fetch(1, 100);
    assert_eq!(r.observe(7, &scored, Some(&f), 0), None);
    assert_eq!(r.observe(7, &scored, None, 600), None);
    assert_eq!(
        r.observe(7, &scored, Some(&f), 1_200),
        None,
        "hot since 1 200"
    );
    assert!(r.observe(7, &scored, Some(&f), 2_200).is_some());
}

#[test]
fn the_budget_bounds_a_ranks_replicas_until_they_are_evicted() {
    let mut r = Replicator::new(config(0, 150));
    let f = fetch(1, 100);
    let before = [rank(0, 100), rank(1, 0)];
    assert!(r.observe(1, &before, Some(&f), 0).is_some());
    // A second prefix would take rank 1 past its 150 blocks.
    assert_eq!(r.observe(2, &before, Some(&f), 0), None);
    assert_eq!(r.spent(before[1].key), 100);
    // Rank 1 still shows prefix 1: nothing released.
    let kept = [rank(0, 100), rank(1, 100)];
    assert_eq!(r.observe(1, &kept, None, 1), None);
    assert_eq!(r.spent(kept[1].key), 100);
    // It evicted it: the budget is free for prefix 2.
    let evicted = [rank(0, 100), rank(1, 10)];
    assert_eq!(r.observe(1, &evicted, None, 2), None);
    assert_eq!(r.spent(evicted[1].key), 0);
    assert!(r.observe(2, &before, Some(&f), 3).is_some());
}

#[test]
fn spent_never_exceeds_the_budget() {
    // Property: whatever sequence of prefixes and sizes, each rank's
    // replicated blocks stay within its budget.
    let mut r = Replicator::new(config(0, 300));
    let scored = [rank(0, 200), rank(1, 0), rank(2, 0)];
    for i in 0..200u64 {
        let to = 1 + (i % 2) as usize;
        let f = fetch(to, (i * 37 % 190 + 4) as u32);
        let _ = r.observe(i % 11, &scored, Some(&f), i);
        for s in &scored {
            assert!(r.spent(s.key) <= 300);
        }
    }
}

#[test]
fn the_prefix_key_is_the_first_blocks_tokens() {
    let a: Vec<u32> = (0..40).collect();
    let mut b = a.clone();
    b[30] = 99;
    assert_eq!(prefix_key(&a, 16), prefix_key(&b, 16));
    b[3] = 99;
    assert_ne!(prefix_key(&a, 16), prefix_key(&b, 16));
    assert_eq!(prefix_key(&[], 16), prefix_key(&[], 16));
}

#[test]
fn the_preview_shows_the_copy_observe_would_make_and_records_nothing() {
    let mut r = Replicator::new(config(1_000, 256));
    let scored = [rank(0, 100), rank(1, 0)];
    let f = fetch(1, 100);
    assert_eq!(r.preview(7, &scored, Some(&f), 0), None, "not hot yet");
    assert_eq!(r.observe(7, &scored, Some(&f), 0), None);
    assert_eq!(r.preview(7, &scored, Some(&f), 999), None);
    let shown = r.preview(7, &scored, Some(&f), 1_000).expect("due");
    assert_eq!(r.spent(scored[1].key), 0, "the preview spent nothing");
    assert_eq!(r.observe(7, &scored, Some(&f), 1_000), Some(shown));
    assert_eq!(r.preview(7, &scored, None, 5_000), None, "a cool holder");
    // With no bound, a saturated prefix is due at once.
    let fresh = Replicator::new(config(0, 256));
    assert!(fresh.preview(9, &scored, Some(&f), 0).is_some());
}
