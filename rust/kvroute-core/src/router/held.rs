//! The blocks the requests in flight hold on each instance, a block several of them share
//! counted once, as the engine holds it: the token cap (`engine_load`), and Dynamo's cost
//! under a `dedup_weight` (`picker`), count a prefix in flight in several requests once.
//!
//! Per instance, a count of holders per key and the number of key occurrences beyond each
//! key's first (`Σ (holders - 1)`, the shared blocks). Adding or removing a request costs
//! O(its keys) hash updates; kept only while one of the two reads it
//! ([`HeldBlocks::tracking`]). A request routed while not tracking holds no keys here, so
//! turning the cap on or off while requests are in flight can leave counts short until
//! those requests end, never negative.
//! Not synchronised (the router's lock).

use rustc_hash::FxHashMap;

/// Holders per key, and the shared blocks, for every instance.
#[derive(Debug, Clone, Default)]
pub(super) struct HeldBlocks {
    /// Empty when not tracking.
    instances: Vec<(FxHashMap<u64, u32>, u64)>,
}

impl HeldBlocks {
    pub fn tracking(&self) -> bool {
        !self.instances.is_empty()
    }

    /// Track `instances` instances from now on (keeping what is tracked), or nothing.
    pub fn track(&mut self, on: bool, instances: usize) {
        match on {
            true => self.instances.resize_with(instances, Default::default),
            false => self.instances.clear(),
        }
    }

    /// Blocks on `instance` that more than one request in flight holds, beyond the first
    /// holder (0 when not tracking).
    pub fn shared_blocks(&self, instance: usize) -> u64 {
        self.instances.get(instance).map_or(0, |(_, shared)| *shared)
    }

    /// Leading blocks of `keys` that a request in flight on `instance` holds (0 when not
    /// tracking): O(that many) lookups.
    pub fn held_prefix(&self, instance: usize, keys: &[u64]) -> u64 {
        let Some((holders, _)) = self.instances.get(instance) else { return 0 };
        keys.iter().take_while(|k| holders.contains_key(k)).count() as u64
    }

    pub fn add_instance(&mut self) {
        if self.tracking() {
            self.instances.push(Default::default());
        }
    }

    /// A request holding `keys` went to `instance`.
    pub fn add(&mut self, instance: usize, keys: &[u64]) {
        let (holders, shared) = &mut self.instances[instance];
        for &k in keys {
            let count = holders.entry(k).or_insert(0);
            if *count > 0 {
                *shared += 1;
            }
            *count += 1;
        }
    }

    /// A request holding `keys` on `instance` ended (nothing when not tracking).
    pub fn remove(&mut self, instance: usize, keys: &[u64]) {
        let Some((holders, shared)) = self.instances.get_mut(instance) else { return };
        for k in keys {
            let Some(count) = holders.get_mut(k) else { continue };
            *count -= 1;
            if *count > 0 {
                *shared -= 1;
            } else {
                holders.remove(k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_shared_in_flight_counts_once() {
        let mut held = HeldBlocks::default();
        held.track(true, 2);
        let mut shared_after = |op: fn(&mut HeldBlocks, usize, &[u64]), i: usize, keys: &[u64]| {
            op(&mut held, i, keys);
            held.shared_blocks(i)
        };
        assert_eq!(shared_after(HeldBlocks::add, 0, &[1, 2, 3]), 0);
        assert_eq!(shared_after(HeldBlocks::add, 0, &[1, 2, 4]), 2);
        assert_eq!(shared_after(HeldBlocks::add, 1, &[1, 2]), 0);
        assert_eq!(shared_after(HeldBlocks::add, 0, &[1, 1]), 4);
        assert_eq!(shared_after(HeldBlocks::remove, 0, &[1, 2, 3]), 2);
        assert_eq!(shared_after(HeldBlocks::remove, 0, &[1, 1]), 0);
        assert_eq!(shared_after(HeldBlocks::remove, 0, &[1, 2, 4]), 0);
        assert!(held.instances[0].0.is_empty());
        held.add(0, &[1, 2, 3]);
        assert_eq!((held.held_prefix(0, &[1, 2, 5, 3]), held.held_prefix(0, &[5, 1])), (2, 0));
        held.track(false, 2);
        assert!(!held.tracking());
        held.remove(1, &[1, 2]);
        assert_eq!(held.shared_blocks(1), 0);
    }
}
