//! Session affinity: each session's instance, optionally bounded to the `capacity` most
//! recently routed sessions (least recently routed forgotten first); or, shared by replicas,
//! derived from where the request's prefix is cached ([`shared_affinity`], O(instances)).
//!
//! A map `session -> (instance, stamp)` and a queue of `(session, stamp)` in routing order;
//! eviction pops the queue's front, skipping entries that a later route made stale, and the
//! queue drops its stale entries when they outnumber the live ones. Set O(1) amortized, get
//! O(1). Not synchronised: owned by the router.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::picker::InstanceLoad;
use crate::Id;

/// Session → instance, with an optional LRU bound.
#[derive(Debug, Clone, Default)]
pub struct Affinity {
    map: FxHashMap<Id, (usize, u64)>,
    order: VecDeque<(Id, u64)>,
    capacity: Option<usize>,
    clock: u64,
}

impl Affinity {
    /// An empty map that keeps at most `capacity` sessions (`None`: every session).
    pub fn new(capacity: Option<usize>) -> Self {
        Self { capacity, ..Self::default() }
    }

    /// The session's instance, if it has one.
    pub fn get(&self, session: &Id) -> Option<usize> {
        self.map.get(session).map(|&(i, _)| i)
    }

    /// Number of sessions with an instance.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no session has an instance.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bind `session` to `instance` as the most recent session.
    pub fn set(&mut self, session: &Id, instance: usize) {
        let Some(cap) = self.capacity else {
            self.map.insert(session.clone(), (instance, 0));
            return;
        };
        self.clock += 1;
        self.map.insert(session.clone(), (instance, self.clock));
        self.order.push_back((session.clone(), self.clock));
        while self.map.len() > cap {
            let Some((old, stamp)) = self.order.pop_front() else { break };
            if self.map.get(&old).is_some_and(|&(_, s)| s == stamp) {
                self.map.remove(&old);
            }
        }
        if self.order.len() > 2 * self.map.len() + 1024 {
            let map = &self.map;
            self.order.retain(|(s, stamp)| map.get(s).is_some_and(|&(_, t)| t == *stamp));
        }
    }
}

/// The shared affinity of session `s` (see [`crate::RouterConfig::shared_affinity`]): the available
/// instance with the most leading keys `matched`, ties and no match at all broken by the
/// highest rendezvous hash of the session and the instance.
pub fn shared_affinity(s: &Id, matched: &[u32], loads: &[InstanceLoad]) -> Option<usize> {
    let seed = match s {
        Id::Int(i) => xxh3_64_with_seed(&i.to_le_bytes(), 1),
        Id::Str(text) => xxh3_64_with_seed(text.as_bytes(), 2),
    };
    (0..loads.len()).filter(|&i| loads[i].available).max_by_key(|&i| {
        (matched.get(i).copied().unwrap_or(0), xxh3_64_with_seed(&(i as u64).to_le_bytes(), seed))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_routed_session_goes_first() {
        let mut a = Affinity::new(Some(2));
        a.set(&Id::Int(1), 0);
        a.set(&Id::Int(2), 1);
        a.set(&Id::Int(1), 1); // 1 is the most recent now
        a.set(&Id::Int(3), 0);
        assert_eq!((a.get(&Id::Int(1)), a.get(&Id::Int(2)), a.get(&Id::Int(3))), (Some(1), None, Some(0)));
        for r in 0..10_000 {
            a.set(&Id::Int(1), r % 3);
        }
        assert!(a.order.len() <= 2 * a.len() + 1024 && a.len() == 2);
        let mut open = Affinity::new(None);
        (0..100).for_each(|s| open.set(&Id::Int(s), 0));
        assert_eq!(open.len(), 100);
    }
}
