//! The router's instances: snapshots, availability, adding one, and each one's cache model
//! (clear, capacity, resident keys). O(1) each but `state` (O(instances)) and `cached_keys`
//! (O(keys held)). Not synchronised, as the [`Router`].

use super::{InstanceState, Router, MAX_INSTANCES};
use crate::error::{Error, Result};
use crate::picker::InstanceLoad;

impl Router {
    /// A snapshot of every instance.
    pub fn state(&self) -> Vec<InstanceState> {
        let cache = self.cache.lock();
        self.loads
            .iter()
            .enumerate()
            .map(|(i, l)| InstanceState {
                load: l.clone(),
                cached_blocks: match &self.events {
                    Some(e) if e.uses_events(i) => e.cached_blocks(i),
                    _ => cache.cached_blocks(i),
                },
                cache_view: self.events.as_ref().map_or("estimate", |e| e.source(i)),
                engine: self.engine.get(i),
                overloaded: self.overloaded(i),
            })
            .collect()
    }

    /// Mark an instance up or down. Down instances take no new requests; their in-flight
    /// requests, counters and cache model stay until those requests finish.
    pub fn set_available(&mut self, instance: i64, available: bool) -> Result<()> {
        let i = self.check_instance(instance)?;
        let load = &mut self.loads[i];
        if load.available != available {
            let (sum, count) = &mut self.available_totals;
            if available {
                *sum += load.num_requests;
                *count += 1;
            } else {
                *sum -= load.num_requests;
                *count -= 1;
            }
            load.available = available;
        }
        Ok(())
    }

    /// Whether `instance` takes part in picks (false for an index out of range).
    pub fn is_available(&self, instance: usize) -> bool {
        self.loads.get(instance).is_some_and(|l| l.available)
    }

    /// Add an available instance with an empty cache; returns its index. An error when the
    /// router already has [`MAX_INSTANCES`].
    pub fn add_instance(&mut self) -> Result<usize> {
        if self.loads.len() >= MAX_INSTANCES {
            return Err(Error::InvalidArgument(format!("a router holds at most {MAX_INSTANCES} instances")));
        }
        self.loads.push(InstanceLoad { available: true, ..InstanceLoad::default() });
        self.available_totals.1 += 1;
        self.engine.add_instance();
        self.held.add_instance();
        if let Some(e) = &mut self.events {
            e.add_instance();
        }
        Ok(self.cache.lock().add_instance())
    }

    /// Empty an instance's cache model (its engine's prefix cache was reset). Its counters
    /// and in-flight requests stay.
    pub fn clear_cache(&mut self, instance: i64) -> Result<()> {
        let i = self.check_instance(instance)?;
        self.cache.lock().clear_instance(i);
        Ok(())
    }

    /// Bound `instance`'s estimate view to `capacity` blocks (`None`: unbounded), such as its
    /// engine's real KV capacity; its least recently touched blocks beyond it are evicted. The
    /// events view sizes its tables for it.
    pub fn set_cache_capacity(&mut self, instance: i64, capacity: Option<usize>) -> Result<()> {
        let i = self.check_instance(instance)?;
        if capacity == Some(0) {
            return Err(Error::InvalidArgument("a cache capacity must be positive or None, got 0".into()));
        }
        self.cache.lock().set_capacity(i, capacity);
        if let (Some(e), Some(blocks)) = (&mut self.events, capacity) {
            e.reserve(i, blocks);
        }
        Ok(())
    }

    /// Keys resident on an instance, most recent first.
    pub fn cached_keys(&self, instance: i64) -> Result<Vec<u64>> {
        Ok(self.cache.lock().keys_mru(self.check_instance(instance)?))
    }
}
