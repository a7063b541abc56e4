//! The fair queue's order and refusals: weighted shares over long runs,
//! priority before fairness, and who a full queue refuses.

use super::*;
use proptest::prelude::*;

/// Serves the first request `serves` times, each tenant in `tenants`
/// (name, weight, cost) topping its backlog up to `backlog` requests before
/// each serve; the cost served to each tenant.
fn serve_backlogged(tenants: &[(&str, f64, u64)], backlog: usize, serves: usize) -> Vec<u64> {
    let mut queue = FairQueue::new();
    let mut served = vec![0u64; tenants.len()];
    for _ in 0..serves {
        for &(name, weight, cost) in tenants {
            while queue.waiting_of(&name) < backlog {
                let _ = queue.admit(usize::MAX, &name, weight, 0, cost);
            }
        }
        let first = queue.first().expect("requests wait");
        let tenant = *queue.order.get(&first).expect("its tenant");
        let i = tenants.iter().position(|t| t.0 == tenant).expect("known");
        served[i] += tenants[i].2;
        queue.leave(first, true);
    }
    served
}

#[test]
fn backlogged_tenants_are_served_in_proportion_to_their_weights() {
    let served = serve_backlogged(&[("a", 1.0, 1), ("b", 3.0, 1)], 20, 4000);
    assert_eq!(served.iter().sum::<u64>(), 4000);
    // SCFQ's bound: within one request per tenant of the exact 1:3 split.
    assert!((999..=1001).contains(&served[0]), "{served:?}");
    assert!((2999..=3001).contains(&served[1]), "{served:?}");
}

#[test]
fn a_tenant_sending_ten_times_more_gets_no_more_than_an_equal_share() {
    // "big" keeps 50 requests waiting, "small" 5: each still gets half.
    let mut queue = FairQueue::new();
    let (mut big, mut small) = (0u32, 0u32);
    for _ in 0..2000 {
        while queue.waiting_of(&"big") < 50 {
            let _ = queue.admit(usize::MAX, &"big", 1.0, 0, 100);
        }
        while queue.waiting_of(&"small") < 5 {
            let _ = queue.admit(usize::MAX, &"small", 1.0, 0, 100);
        }
        let first = queue.first().expect("waiting");
        match queue.order[&first] {
            "big" => big += 1,
            _ => small += 1,
        }
        queue.leave(first, true);
    }
    assert!(big.abs_diff(small) <= 1, "big {big}, small {small}");
}

#[test]
fn costs_count_not_requests() {
    // "long" sends prompts 4 times as long: it gets a quarter of the requests.
    let served = serve_backlogged(&[("long", 1.0, 400), ("short", 1.0, 100)], 8, 5000);
    let (long_requests, short_requests) = (served[0] / 400, served[1] / 100);
    assert!(
        (short_requests as f64 / long_requests as f64 - 4.0).abs() < 0.05,
        "{long_requests} long, {short_requests} short"
    );
}

#[test]
fn priority_comes_before_fairness_and_arrival_breaks_ties() {
    let mut queue = FairQueue::new();
    let low = queue.admit(8, &"a", 1.0, 5, 1);
    let normal = queue.admit(8, &"a", 1.0, 0, 1);
    let urgent = queue.admit(8, &"b", 1.0, -1, 1);
    let normal_b = queue.admit(8, &"b", 1.0, 0, 1);
    let order: Vec<Place> = queue.order.keys().copied().collect();
    let places = [urgent, normal, normal_b, low].map(|a| match a {
        Admission::Queued(p) => p,
        other => panic!("{other:?}"),
    });
    assert_eq!(order, places);
}

#[test]
fn on_equal_tags_a_tenant_without_a_backlog_goes_before_one_with_one() {
    let mut queue = FairQueue::new();
    for _ in 0..3 {
        let _ = queue.admit(8, &"big", 1.0, 0, 10);
    }
    let first = queue.first().expect("big waits");
    queue.leave(first, true);
    // big's next tag and small's first are equal: small had nothing waiting.
    let Admission::Queued(small) = queue.admit(8, &"small", 1.0, 0, 10) else {
        panic!("queued");
    };
    assert_eq!(queue.first(), Some(small));
}

#[test]
fn a_tenants_own_requests_keep_their_arrival_order() {
    let mut queue = FairQueue::new();
    let mut places = Vec::new();
    for cost in [50, 1, 7, 300, 2] {
        if let Admission::Queued(p) = queue.admit(16, &"t", 2.0, 0, cost) {
            places.push(p);
        }
    }
    let order: Vec<Place> = queue.order.keys().copied().collect();
    assert_eq!(order, places);
}

#[test]
fn a_full_queue_refuses_from_the_tenant_most_over_its_share() {
    let mut queue = FairQueue::new();
    let mut big = Vec::new();
    for _ in 0..4 {
        match queue.admit(4, &"big", 1.0, 0, 10) {
            Admission::Queued(p) => big.push(p),
            other => panic!("{other:?}"),
        }
    }
    // The big tenant's next request is its own refusal.
    assert_eq!(queue.admit(4, &"big", 1.0, 0, 10), Admission::Refused);
    // A small tenant takes the place of the big one's newest request.
    let Admission::Evicting(small, evicted) = queue.admit(4, &"small", 1.0, 0, 10) else {
        panic!("the small tenant is queued");
    };
    assert_eq!(evicted, big[3]);
    assert!(!queue.contains(evicted) && queue.contains(small));
    assert_eq!(queue.len(), 4);
    // The small tenant is served next: its tag starts at the virtual time.
    queue.leave(big[0], true);
    assert_eq!(queue.first(), Some(small));
    // Once both hold two places (equal weights), each refuses its own.
    let _ = queue.admit(4, &"small", 1.0, 0, 10);
    assert_eq!(queue.waiting_of(&"big"), 2);
    assert_eq!(queue.admit(4, &"small", 1.0, 0, 10), Admission::Refused);
    assert_eq!(queue.admit(4, &"big", 1.0, 0, 10), Admission::Refused);
}

#[test]
fn a_heavier_tenant_holds_more_places_and_its_urgent_request_displaces_its_own() {
    let mut queue = FairQueue::new();
    for _ in 0..3 {
        let _ = queue.admit(4, &"gold", 3.0, 5, 1);
    }
    let _ = queue.admit(4, &"free", 1.0, 0, 1);
    // gold: 4 / 3 against free: 1 / 1; gold is over, and its newcomer
    // outranks its own low-priority requests: the last of those goes.
    let last_gold = queue.flows[&"gold"]
        .places
        .last()
        .copied()
        .expect("gold waits");
    match queue.admit(4, &"gold", 3.0, -1, 1) {
        Admission::Evicting(p, evicted) => {
            assert_eq!(evicted, last_gold);
            assert_eq!(queue.first(), Some(p));
        }
        other => panic!("{other:?}"),
    }
    // free's second request: 2 / 1 against gold's 3 / 3: free's own refusal.
    assert_eq!(queue.admit(4, &"free", 1.0, 0, 1), Admission::Refused);
}

#[test]
fn state_is_forgotten_once_nothing_waits() {
    let mut queue = FairQueue::new();
    let places: Vec<Place> = (0..6)
        .filter_map(
            |i| match queue.admit(8, &(i % 3), 1.0, i64::from(i % 2), 5) {
                Admission::Queued(p) => Some(p),
                _ => None,
            },
        )
        .collect();
    for (i, p) in places.into_iter().enumerate() {
        queue.leave(p, i % 2 == 0);
    }
    assert!(queue.is_empty());
    assert!(queue.flows.is_empty() && queue.clocks.is_empty());
    // Leaving twice, or an unknown place, changes nothing.
    queue.leave(level_start(0), true);
    assert!(queue.is_empty());
}

/// A full queue of `capacity` places, every request a new made-up tenant
/// (a Sybil flood) waiting as [`FairQueue::queue_as`] says with `cap`, then
/// `honest` requests of the known tenant `small`: how many of those were
/// refused, and the queue.
fn sybil_flood(capacity: usize, cap: usize, honest: usize) -> (usize, FairQueue<String>) {
    let mut queue = FairQueue::new();
    let pool = "other".to_owned();
    let known = |k: &String| k == "small" || k == "other";
    for i in 0..capacity * 3 {
        let name = format!("sybil-{i}");
        let tenant = queue.queue_as(&name, cap, &pool, known).clone();
        let _ = queue.admit(capacity, &tenant, 1.0, 0, 10);
    }
    assert_eq!(queue.len(), capacity);
    let small = "small".to_owned();
    let refused = (0..honest)
        .filter(|_| {
            let tenant = queue.queue_as(&small, cap, &pool, known).clone();
            queue.admit(capacity, &tenant, 1.0, 0, 10) == Admission::Refused
        })
        .count();
    (refused, queue)
}

#[test]
fn unknown_tenants_beyond_the_cap_wait_as_one() {
    let mut queue: FairQueue<&str> = FairQueue::new();
    let known = |k: &&str| *k == "gold" || *k == "other";
    let _ = queue.admit(8, &"a", 1.0, 0, 1);
    let _ = queue.admit(8, &"b", 1.0, 0, 1);
    // Two unknown tenants wait: a third unknown one is pooled, a known
    // one and a waiting one keep their own names.
    assert_eq!(*queue.queue_as(&"c", 2, &"other", known), "other");
    assert_eq!(*queue.queue_as(&"gold", 2, &"other", known), "gold");
    assert_eq!(*queue.queue_as(&"a", 2, &"other", known), "a");
    assert_eq!(*queue.queue_as(&"c", 3, &"other", known), "c");
    // Pooled requests and known tenants do not count against the cap.
    let _ = queue.admit(8, &"other", 1.0, 0, 1);
    let _ = queue.admit(8, &"gold", 1.0, 0, 1);
    assert_eq!(*queue.queue_as(&"c", 3, &"other", known), "c");
}

#[test]
fn made_up_tenant_names_cannot_crowd_a_known_tenant_out() {
    // Without a cap (as before), every honest request meets a full queue of
    // one-request tenants, ties with each and is refused.
    let (refused, _) = sybil_flood(8, usize::MAX, 6);
    assert_eq!(refused, 6);
    // With a cap of 2, the six pooled Sybil requests are one tenant: the
    // honest tenant takes places from the pool until it holds as many as
    // the pool does (3 of 6), and only then is refused.
    let (refused, mut queue) = sybil_flood(8, 2, 6);
    assert_eq!(refused, 3);
    assert_eq!(queue.waiting_of(&"small".to_owned()), 3);
    assert_eq!(queue.waiting_of(&"other".to_owned()), 3);
    // Served in fair order, the honest tenant's first request is among
    // the first cap + 2 served (one per tenant waiting).
    let mut served = Vec::new();
    while let Some(first) = queue.first() {
        served.push(queue.order[&first].clone());
        queue.leave(first, true);
    }
    let first_small = served.iter().position(|t| t == "small");
    assert!(first_small.is_some_and(|p| p < 4), "{served:?}");
}

#[test]
fn weights_are_clamped_to_a_finite_range() {
    assert_eq!(clamp_weight(0.0), WEIGHT_RANGE.0);
    assert_eq!(clamp_weight(f64::INFINITY), WEIGHT_RANGE.1);
    assert_eq!(clamp_weight(f64::NAN), 1.0);
    assert_eq!(clamp_weight(2.5), 2.5);
}

proptest! {
    /// SCFQ's fairness bound: while tenants stay backlogged, the cost each
    /// is served over its weight differs from another's by at most one
    /// largest request of each.
    #[test]
    fn backlogged_shares_stay_within_one_request_of_the_weights(
        tenants in proptest::collection::vec((1u32..8, 1u64..50), 2..5),
        serves in 200usize..1500,
    ) {
        let names = ["a", "b", "c", "d"];
        let mut queue = FairQueue::new();
        let mut served = vec![0u64; tenants.len()];
        let c_max = tenants.iter().map(|t| t.1).max().unwrap_or(1) as f64;
        for _ in 0..serves {
            for (i, &(w, c)) in tenants.iter().enumerate() {
                while queue.waiting_of(&names[i]) < 4 {
                    let _ = queue.admit(usize::MAX, &names[i], f64::from(w), 0, c);
                }
            }
            let first = queue.first().expect("waiting");
            let i = names.iter().position(|n| *n == queue.order[&first]).expect("known");
            served[i] += tenants[i].1;
            queue.leave(first, true);
        }
        for i in 0..tenants.len() {
            for j in 0..tenants.len() {
                let (wi, wj) = (f64::from(tenants[i].0), f64::from(tenants[j].0));
                let gap = (served[i] as f64 / wi - served[j] as f64 / wj).abs();
                prop_assert!(gap <= c_max / wi + c_max / wj + 1e-6, "{served:?} {tenants:?}");
            }
        }
    }
}
