//! A bounded table whose entries expire: what a prefill engine keeps for its
//! decode engines (held transfers, SGLang bootstrap rooms).
//!
//! Every entry has a lease that ends `lease` after it was last inserted or
//! renewed; [`LeaseTable::purge`] removes the entries whose lease ended. The
//! table never holds more than its capacity: inserting a new key into a full
//! table evicts the entry whose lease ends first. Pure: the caller passes the
//! time, so tests need no clock.

use std::collections::BTreeMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

#[derive(Debug, Clone)]
struct Entry<V> {
    value: V,
    /// The entry's key in `order`.
    expires: (Instant, u64),
}

/// A map with a lease per entry and a fixed capacity.
#[derive(Debug, Clone)]
pub struct LeaseTable<K, V> {
    entries: FxHashMap<K, Entry<V>>,
    /// Keys by lease end (ties broken by insertion order).
    order: BTreeMap<(Instant, u64), K>,
    next_seq: u64,
    capacity: usize,
    lease: Duration,
}

impl<K: Eq + Hash + Clone, V> LeaseTable<K, V> {
    /// An empty table of at most `capacity` entries (at least 1), each living
    /// `lease` after its last insertion or renewal.
    pub fn new(capacity: usize, lease: Duration) -> Self {
        LeaseTable {
            entries: FxHashMap::default(),
            order: BTreeMap::new(),
            next_seq: 0,
            capacity: capacity.max(1),
            lease,
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The lease of every entry.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// When the next lease ends, if any entry is held.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.order.keys().next().map(|&(at, _)| at)
    }

    fn stamp(&mut self, now: Instant) -> (Instant, u64) {
        let seq = self.next_seq;
        self.next_seq += 1;
        (now + self.lease, seq)
    }

    /// Inserts or replaces `key`'s value with a fresh lease. A new key in a
    /// full table first evicts the entry whose lease ends soonest, which is
    /// returned (expired entries should be [`LeaseTable::purge`]d first).
    pub fn insert(&mut self, key: K, value: V, now: Instant) -> Option<(K, V)> {
        let expires = self.stamp(now);
        if let Some(entry) = self.entries.get_mut(&key) {
            self.order.remove(&entry.expires);
            entry.value = value;
            entry.expires = expires;
            self.order.insert(expires, key);
            return None;
        }
        let evicted = if self.entries.len() >= self.capacity {
            self.pop_first()
        } else {
            None
        };
        self.order.insert(expires, key.clone());
        self.entries.insert(key, Entry { value, expires });
        evicted
    }

    fn pop_first(&mut self) -> Option<(K, V)> {
        let (_, key) = self.order.pop_first()?;
        let entry = self.entries.remove(&key)?;
        Some((key, entry.value))
    }

    /// Starts `key`'s lease again; false when it is not held.
    pub fn renew(&mut self, key: &K, now: Instant) -> bool {
        let expires = self.stamp(now);
        let Some(entry) = self.entries.get_mut(key) else {
            return false;
        };
        self.order.remove(&entry.expires);
        entry.expires = expires;
        self.order.insert(expires, key.clone());
        true
    }

    /// The value of `key`.
    pub fn get(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|e| &e.value)
    }

    /// The value of `key`, to change in place (the lease is unchanged).
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.entries.get_mut(key).map(|e| &mut e.value)
    }

    /// Removes `key`.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let entry = self.entries.remove(key)?;
        self.order.remove(&entry.expires);
        Some(entry.value)
    }

    /// Removes and returns every entry whose lease ended at or before `now`,
    /// soonest first.
    pub fn purge(&mut self, now: Instant) -> Vec<(K, V)> {
        let mut expired = Vec::new();
        while let Some(&(at, _)) = self.order.keys().next() {
            if at > now {
                break;
            }
            match self.pop_first() {
                Some(kv) => expired.push(kv),
                None => break,
            }
        }
        expired
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    #[test]
    fn entries_expire_a_lease_after_their_last_insertion_or_renewal() {
        let t0 = Instant::now();
        let mut table = LeaseTable::new(8, LEASE);
        assert_eq!(table.insert(1, "a", t0), None);
        assert_eq!(table.insert(2, "b", t0 + Duration::from_secs(10)), None);
        assert_eq!(table.next_expiry(), Some(t0 + LEASE));
        assert!(table
            .purge(t0 + LEASE - Duration::from_millis(1))
            .is_empty());
        assert!(table.renew(&1, t0 + Duration::from_secs(20)));
        assert!(!table.renew(&3, t0));
        // 2 ends at 40 s, 1 now at 50 s.
        assert_eq!(table.purge(t0 + Duration::from_secs(45)), [(2, "b")]);
        assert_eq!(table.get(&1), Some(&"a"));
        assert_eq!(table.purge(t0 + Duration::from_secs(50)), [(1, "a")]);
        assert!(table.is_empty());
        assert_eq!(table.next_expiry(), None);
    }

    #[test]
    fn a_full_table_evicts_the_entry_whose_lease_ends_first() {
        let t0 = Instant::now();
        let mut table = LeaseTable::new(2, LEASE);
        table.insert("x", 1, t0);
        table.insert("y", 2, t0 + Duration::from_secs(1));
        // Replacing an existing key never evicts, and renews its lease.
        assert_eq!(table.insert("x", 10, t0 + Duration::from_secs(2)), None);
        assert_eq!(table.len(), 2);
        assert_eq!(
            table.insert("z", 3, t0 + Duration::from_secs(3)),
            Some(("y", 2))
        );
        assert_eq!(table.get(&"x"), Some(&10));
        assert_eq!(table.remove(&"x"), Some(10));
        assert_eq!(table.remove(&"x"), None);
        assert_eq!(table.len(), 1);
        if let Some(v) = table.get_mut(&"z") {
            *v = 4;
        }
        assert_eq!(table.purge(t0 + Duration::from_secs(60)), [("z", 4)]);
    }

    #[test]
    fn a_zero_capacity_still_holds_one_entry() {
        let t0 = Instant::now();
        let mut table = LeaseTable::new(0, LEASE);
        assert_eq!(table.insert(1u64, (), t0), None);
        assert_eq!(table.insert(2u64, (), t0), Some((1, ())));
        table.clear();
        assert!(table.is_empty());
        assert_eq!(table.lease(), LEASE);
    }
}
