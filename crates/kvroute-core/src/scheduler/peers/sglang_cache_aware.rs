//! SGLang router's `cache_aware` policy, re-implemented from its rules as a
//! baseline (`--policy sglang-cache-aware`).
//!
//! Follows `sgl-project/sglang:sgl-router/src/policies/cache_aware.rs` and
//! `tree.rs` (the 2025 `sgl-router`, which became SMG's
//! `model_gateway/src/policies/`, same rules), read for its rules only:
//!
//! * the router counts the requests it has in flight on each worker (its
//!   `load`: up when routed, down when the response ends);
//! * **imbalance**: when `max − min > balance_abs_threshold` **and**
//!   `max > balance_rel_threshold × min`, the least-loaded worker (first of
//!   equals) gets the request, and the request is still inserted in the tree
//!   for it;
//! * otherwise the request is matched against one radix tree shared by all
//!   workers (each node lists the workers, *tenants*, that were sent a
//!   request through it, with when): the deepest node the request reaches
//!   names the worker; if `matched / request length > cache_threshold` that
//!   worker gets it, else the worker whose tree holds the fewest symbols;
//!   either way the request is inserted for the chosen worker;
//! * every `eviction_interval` the tree is pruned: each tenant holding more
//!   than `max_tree_size` symbols loses its least recently used leaves until
//!   it holds no more.
//!
//! The tree holds what the router *sent*, never what the engines cache:
//! nothing tells it of an engine's evictions. sglang's HTTP gateway keys the
//! tree by the characters of the request's text; its gRPC path by token
//! ids. Here a request is any sequence of `u32` symbols: token ids when the
//! router has them (the simulator always does), else the text's characters.
//! Where sglang takes "the first tenant" of a node (a hash map's first key),
//! this takes the lowest tenant id: as arbitrary, and reproducible.
//!
//! Defaults ([`CacheAwareConfig::default`]): `cache_threshold` 0.5 (the
//! `sglang_router.launch_router` CLI), `balance_abs_threshold` 64,
//! `balance_rel_threshold` 1.5, `eviction_interval` 120 s and
//! `max_tree_size` 2²⁶ (SMG's CLI, `model_gateway/src/main.rs`).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use rustc_hash::FxHashMap;

/// The policy's settings (sglang's flags of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareConfig {
    /// Matched share of the request above which the matched worker gets it.
    pub cache_threshold: f64,
    /// Load spread (`max − min` requests) above which, with the relative
    /// one, the least-loaded worker gets the request.
    pub balance_abs_threshold: u64,
    /// `max > min × this` (with the absolute one) means imbalance.
    pub balance_rel_threshold: f64,
    /// Milliseconds between two prunings of the tree (0: never).
    pub eviction_interval_ms: u64,
    /// Symbols each tenant may keep at a pruning.
    pub max_tree_size: usize,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        CacheAwareConfig {
            cache_threshold: 0.5,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval_ms: 120_000,
            max_tree_size: 1 << 26,
        }
    }
}

type NodeId = usize;

#[derive(Debug, Clone, Default)]
struct Node {
    symbols: Vec<u32>,
    children: FxHashMap<u32, NodeId>,
    parent: Option<NodeId>,
    /// Tenant → last access (ms).
    tenants: BTreeMap<u32, u64>,
}

/// sglang's multi-tenant approximate radix tree: one tree for every
/// worker, each node marked with the tenants (workers) whose requests went
/// through it and when they last did.
#[derive(Debug, Clone)]
pub struct TenantTree {
    nodes: Vec<Node>,
    free: Vec<NodeId>,
    sizes: BTreeMap<u32, usize>,
}

const ROOT: NodeId = 0;

impl Default for TenantTree {
    fn default() -> Self {
        Self::new()
    }
}

fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl TenantTree {
    /// An empty tree.
    pub fn new() -> Self {
        TenantTree {
            nodes: vec![Node::default()],
            free: Vec::new(),
            sizes: BTreeMap::new(),
        }
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id] = node;
                id
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// Marks `id` as `tenant`'s at `now`, counting its symbols for the
    /// tenant the first time.
    fn touch(&mut self, id: NodeId, tenant: u32, now: u64) {
        let len = self.nodes[id].symbols.len();
        if self.nodes[id].tenants.insert(tenant, now).is_none() {
            *self.sizes.entry(tenant).or_insert(0) += len;
        }
    }

    /// Records that `symbols` went to `tenant` at `now_ms` (sglang's
    /// `insert`): nodes are split where the request leaves them, and every
    /// node on its path is marked for the tenant.
    pub fn insert(&mut self, symbols: &[u32], tenant: u32, now_ms: u64) {
        self.touch(ROOT, tenant, now_ms);
        let (mut at, mut i) = (ROOT, 0);
        while i < symbols.len() {
            let child = self.nodes[at].children.get(&symbols[i]).copied();
            let Some(child) = child else {
                let id = self.alloc(Node {
                    symbols: symbols[i..].to_vec(),
                    parent: Some(at),
                    ..Node::default()
                });
                self.nodes[at].children.insert(symbols[i], id);
                self.touch(id, tenant, now_ms);
                return;
            };
            let shared = shared_prefix(&self.nodes[child].symbols, &symbols[i..]);
            let node = if shared < self.nodes[child].symbols.len() {
                self.split(child, shared)
            } else {
                child
            };
            self.touch(node, tenant, now_ms);
            at = node;
            i += shared;
        }
    }

    /// Splits `child` after its first `at` symbols; returns the new upper
    /// node (which keeps the tenants, so their sizes do not change).
    fn split(&mut self, child: NodeId, at: usize) -> NodeId {
        let parent = self.nodes[child].parent.unwrap_or(ROOT);
        let lower = self.nodes[child].symbols.split_off(at);
        let upper_symbols = std::mem::replace(&mut self.nodes[child].symbols, lower);
        let first = upper_symbols[0];
        let upper = self.alloc(Node {
            symbols: upper_symbols,
            children: FxHashMap::default(),
            parent: Some(parent),
            tenants: self.nodes[child].tenants.clone(),
        });
        let lower_first = self.nodes[child].symbols[0];
        self.nodes[upper].children.insert(lower_first, child);
        self.nodes[child].parent = Some(upper);
        self.nodes[parent].children.insert(first, upper);
        upper
    }

    /// The longest prefix of `symbols` in the tree, in symbols (a node
    /// matched in part counts its matched part), and the tenant of the
    /// deepest node reached (its lowest id; `None` on an empty tree). The
    /// tenant's access times are refreshed up to the root, as sglang does.
    pub fn prefix_match(&mut self, symbols: &[u32], now_ms: u64) -> (usize, Option<u32>) {
        let (mut at, mut i) = (ROOT, 0);
        while i < symbols.len() {
            let Some(&child) = self.nodes[at].children.get(&symbols[i]) else {
                break;
            };
            let shared = shared_prefix(&self.nodes[child].symbols, &symbols[i..]);
            i += shared;
            at = child;
            if shared < self.nodes[child].symbols.len() {
                break;
            }
        }
        let tenant = self.nodes[at].tenants.keys().next().copied();
        if let Some(t) = tenant {
            let mut node = Some(at);
            while let Some(id) = node {
                self.nodes[id].tenants.insert(t, now_ms);
                node = self.nodes[id].parent;
            }
        }
        (i, tenant)
    }

    /// The tenant holding the fewest symbols (the lowest id of equals).
    pub fn smallest_tenant(&self) -> Option<u32> {
        let mut best: Option<(usize, u32)> = None;
        for (&t, &size) in &self.sizes {
            if best.is_none_or(|(s, _)| size < s) {
                best = Some((size, t));
            }
        }
        best.map(|(_, t)| t)
    }

    /// Symbols the tree holds for `tenant`.
    pub fn size(&self, tenant: u32) -> usize {
        self.sizes.get(&tenant).copied().unwrap_or(0)
    }

    /// Whether no node below `id` is `tenant`'s: `id` is a leaf for it.
    fn leaf_for(&self, id: NodeId, tenant: u32) -> bool {
        self.nodes[id].tenants.contains_key(&tenant)
            && !self.nodes[id]
                .children
                .values()
                .any(|&c| self.nodes[c].tenants.contains_key(&tenant))
    }

    /// sglang's `evict_tenant_by_size`: every tenant over `max_size`
    /// symbols loses its least recently used leaves (a node whose last
    /// tenant leaves is removed) until it is within `max_size`.
    pub fn evict(&mut self, max_size: usize) {
        let mut heap = BinaryHeap::new();
        for id in 0..self.nodes.len() {
            if self.is_free(id) {
                continue;
            }
            for (&t, &at) in &self.nodes[id].tenants {
                if self.leaf_for(id, t) {
                    heap.push(Reverse((at, t, id)));
                }
            }
        }
        while let Some(Reverse((_, tenant, id))) = heap.pop() {
            if self.size(tenant) <= max_size {
                continue;
            }
            if self.nodes[id].tenants.remove(&tenant).is_none() {
                continue;
            }
            let len = self.nodes[id].symbols.len();
            if let Some(s) = self.sizes.get_mut(&tenant) {
                *s = s.saturating_sub(len);
            }
            let parent = self.nodes[id].parent;
            if id != ROOT && self.nodes[id].tenants.is_empty() && self.nodes[id].children.is_empty()
            {
                self.remove_node(id);
            }
            if let Some(p) = parent {
                if self.leaf_for(p, tenant) {
                    let at = self.nodes[p].tenants[&tenant];
                    heap.push(Reverse((at, tenant, p)));
                }
            }
        }
    }

    fn is_free(&self, id: NodeId) -> bool {
        id != ROOT && self.nodes[id].parent.is_none()
    }

    fn remove_node(&mut self, id: NodeId) {
        if let Some(p) = self.nodes[id].parent {
            let first = self.nodes[id].symbols.first().copied();
            if let Some(first) = first {
                self.nodes[p].children.remove(&first);
            }
        }
        self.nodes[id] = Node::default();
        self.free.push(id);
    }

    /// Forgets `tenant` everywhere (a worker that left).
    pub fn remove_tenant(&mut self, tenant: u32) {
        for id in (0..self.nodes.len()).rev() {
            if self.is_free(id) {
                continue;
            }
            self.nodes[id].tenants.remove(&tenant);
        }
        // Remove emptied nodes from the leaves up.
        let mut changed = true;
        while changed {
            changed = false;
            for id in 1..self.nodes.len() {
                let n = &self.nodes[id];
                if !self.is_free(id) && n.tenants.is_empty() && n.children.is_empty() {
                    self.remove_node(id);
                    changed = true;
                }
            }
        }
        self.sizes.remove(&tenant);
    }
}

/// The policy's state: its tree and when it was last pruned.
#[derive(Debug, Clone)]
pub struct CacheAware {
    config: CacheAwareConfig,
    tree: TenantTree,
    next_eviction_ms: Option<u64>,
}

/// Why [`CacheAware::choose`] chose as it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Loads were imbalanced: the least-loaded worker.
    Imbalanced,
    /// The matched share was over the threshold: the matched worker.
    Matched,
    /// The matched share was not: the worker with the smallest tree.
    SmallestTree,
}

impl Default for CacheAware {
    /// An empty tree with sglang's defaults.
    fn default() -> Self {
        CacheAware::new(CacheAwareConfig::default())
    }
}

impl CacheAware {
    /// An empty tree with these settings.
    pub fn new(config: CacheAwareConfig) -> Self {
        CacheAware {
            config,
            tree: TenantTree::new(),
            next_eviction_ms: None,
        }
    }

    /// The tree (tests, reports).
    pub fn tree(&self) -> &TenantTree {
        &self.tree
    }

    /// Chooses among `loads` — each worker's tenant id and the requests
    /// the router has in flight there — for a request of `symbols` at
    /// `now_ms`, and inserts the request in the tree for it. Returns the
    /// position in `loads` and why; `None` when `loads` is empty.
    pub fn choose(
        &mut self,
        symbols: &[u32],
        loads: &[(u32, u64)],
        now_ms: u64,
    ) -> Option<(usize, Reason)> {
        self.maybe_evict(now_ms);
        for &(t, _) in loads {
            if !self.tree.nodes[ROOT].tenants.contains_key(&t) {
                self.tree.insert(&[], t, now_ms);
            }
        }
        let max = loads.iter().map(|l| l.1).max()?;
        let min = loads.iter().map(|l| l.1).min()?;
        let c = &self.config;
        let imbalanced = max.saturating_sub(min) > c.balance_abs_threshold
            && max as f64 > min as f64 * c.balance_rel_threshold;
        let (pos, reason) = if imbalanced {
            let pos = loads.iter().position(|l| l.1 == min)?;
            (pos, Reason::Imbalanced)
        } else {
            let (matched, tenant) = self.tree.prefix_match(symbols, now_ms);
            let rate = if symbols.is_empty() {
                0.0
            } else {
                matched as f64 / symbols.len() as f64
            };
            let (tenant, reason) = if rate > c.cache_threshold {
                (tenant, Reason::Matched)
            } else {
                (self.tree.smallest_tenant(), Reason::SmallestTree)
            };
            match tenant.and_then(|t| loads.iter().position(|l| l.0 == t)) {
                Some(pos) => (pos, reason),
                None => {
                    // A worker that left: forget it, take the first.
                    if let Some(t) = tenant {
                        self.tree.remove_tenant(t);
                    }
                    (0, reason)
                }
            }
        };
        self.tree.insert(symbols, loads[pos].0, now_ms);
        Some((pos, reason))
    }

    /// Prunes the tree when its interval has passed since the first request
    /// (sglang's background thread, on the request's clock).
    fn maybe_evict(&mut self, now_ms: u64) {
        let interval = self.config.eviction_interval_ms;
        if interval == 0 {
            return;
        }
        match self.next_eviction_ms {
            None => self.next_eviction_ms = Some(now_ms + interval),
            Some(at) if now_ms >= at => {
                self.tree.evict(self.config.max_tree_size);
                self.next_eviction_ms = Some(now_ms + interval);
            }
            Some(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(text: &str) -> Vec<u32> {
        text.chars().map(u32::from).collect()
    }

    fn policy() -> CacheAware {
        CacheAware::new(CacheAwareConfig {
            balance_abs_threshold: 4,
            balance_rel_threshold: 1.5,
            ..CacheAwareConfig::default()
        })
    }

    #[test]
    fn the_tree_counts_each_tenants_symbols_and_matches_the_longest_prefix() {
        let mut t = TenantTree::new();
        t.insert(&s("apple"), 1, 0);
        t.insert(&s("apricot"), 1, 1);
        t.insert(&s("banana"), 2, 2);
        t.insert(&s("application"), 2, 3);
        // tenant 1: "ap" + "ple" + "ricot"; tenant 2: "banana" + "ap" + "pl" + "ication".
        assert_eq!((t.size(1), t.size(2)), (10, 6 + 2 + 2 + 7));
        assert_eq!(t.prefix_match(&s("apricots"), 4), (7, Some(1)));
        assert_eq!(t.prefix_match(&s("bandana"), 5), (3, Some(2)));
        // "appl" reaches the node both share: the lowest tenant.
        assert_eq!(t.prefix_match(&s("applx"), 6), (4, Some(1)));
        assert_eq!(t.prefix_match(&s("zebra"), 7).0, 0);
        assert_eq!(t.smallest_tenant(), Some(1));
    }

    #[test]
    fn a_match_above_the_threshold_goes_to_its_worker() {
        let mut p = policy();
        let loads = [(0, 0), (1, 0), (2, 0)];
        p.tree.insert(&s("xx"), 0, 0);
        p.tree.insert(&s("yyyy"), 2, 0);
        p.tree.insert(&s("system prompt one"), 1, 0);
        let got = p.choose(&s("system prompt one, question"), &loads, 1);
        assert_eq!(got, Some((1, Reason::Matched)));
    }

    #[test]
    fn a_match_at_or_below_the_threshold_goes_to_the_smallest_tree() {
        let mut p = policy();
        let loads = [(0, 0), (1, 0), (2, 0)];
        p.tree.insert(&s("abcdefgh"), 0, 0);
        p.tree.insert(&s("zz"), 1, 0);
        p.tree.insert(&s("qqqq"), 2, 0);
        // Half of "abcdWXYZ" matches worker 0: not over 0.5.
        let got = p.choose(&s("abcdWXYZ"), &loads, 1);
        assert_eq!(got, Some((1, Reason::SmallestTree)));
        // And it is now recorded for worker 1.
        assert_eq!(p.tree.prefix_match(&s("abcdWXYZ"), 2), (8, Some(1)));
    }

    #[test]
    fn imbalance_needs_both_thresholds_and_sends_to_the_least_loaded() {
        let mut p = policy();
        p.tree.insert(&s("hot prefix"), 0, 0);
        // Spread 5 > 4 and 9 > 1.5 × 4: imbalanced.
        let got = p.choose(&s("hot prefix"), &[(0, 9), (1, 4), (2, 6)], 1);
        assert_eq!(got, Some((1, Reason::Imbalanced)));
        // Spread 5 > 4 but 25 ≤ 1.5 × 20: balanced, the cache decides.
        let got = p.choose(&s("hot prefix"), &[(0, 25), (1, 20), (2, 22)], 2);
        assert_eq!(got.map(|g| g.1), Some(Reason::Matched));
        // Spread 4 is not over 4.
        let got = p.choose(&s("hot prefix"), &[(0, 4), (1, 0), (2, 0)], 3);
        assert_eq!(got.map(|g| g.1), Some(Reason::Matched));
    }

    #[test]
    fn eviction_drops_least_recently_used_leaves_down_to_the_size() {
        let mut t = TenantTree::new();
        t.insert(&s("aaaa1111"), 7, 10);
        t.insert(&s("aaaa2222"), 7, 20);
        t.insert(&s("aaaa3333"), 7, 30);
        t.insert(&s("aaaa2222"), 8, 40);
        assert_eq!(t.size(7), 4 + 3 * 4);
        t.evict(9);
        // "1111" (t=10) then "2222" (t=20) leave; "aaaa3333" stays.
        assert_eq!(t.size(7), 8);
        assert_eq!(t.prefix_match(&s("aaaa1111"), 50), (4, Some(7)));
        assert_eq!(t.prefix_match(&s("aaaa3333"), 51), (8, Some(7)));
        // Tenant 8 was within size: its path is whole.
        assert_eq!(t.size(8), 8);
        assert_eq!(t.prefix_match(&s("aaaa2222"), 52), (8, Some(8)));
        t.evict(0);
        assert_eq!((t.size(7), t.size(8)), (0, 0));
        assert_eq!(t.prefix_match(&s("aaaa2222"), 53).0, 0);
    }

    #[test]
    fn the_policy_prunes_its_tree_at_each_interval() {
        let mut p = CacheAware::new(CacheAwareConfig {
            eviction_interval_ms: 100,
            max_tree_size: 4,
            ..CacheAwareConfig::default()
        });
        let loads = [(0, 0)];
        p.choose(&s("abcdefgh"), &loads, 0);
        p.choose(&s("ijklmnop"), &loads, 50);
        assert_eq!(p.tree().size(0), 16);
        p.choose(&s("qrst"), &loads, 100);
        // Pruned before the third request was inserted.
        assert!(p.tree().size(0) <= 4 + 4, "{}", p.tree().size(0));
    }

    #[test]
    fn a_worker_that_left_is_forgotten() {
        let mut p = policy();
        p.tree.insert(&s("shared prefix"), 5, 0);
        let got = p.choose(&s("shared prefix!"), &[(1, 0), (2, 0)], 1);
        assert_eq!(got, Some((0, Reason::Matched)));
        assert_eq!(p.tree().size(5), 0);
    }
}
