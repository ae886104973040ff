//! The router's events view: engines' KV-cache event batches applied, resyncs and resets, and
//! the estimate taking over an instance whose view is not whole; `merge` picks, per instance,
//! the view routing reads. A batch costs O(its blocks); a takeover O(blocks the view held).
//! Not synchronised, as the [`Router`].

use super::Router;
use crate::cache::PrefixWalk;
use crate::error::{Error, Result};
use crate::events::{Applied, EventBatch, EventView, ViewReport};

impl Router {
    /// Apply one batch of `instance`'s KV-cache events (`seq`: its sequence number; `replayed`:
    /// it came from the engine's replay socket; `source_rank`: the rank whose socket it came
    /// from, when known: a batch naming another rank is refused, see
    /// [`EventView::apply`](crate::events::EventView::apply)). Needs
    /// [`CacheView::Events`](super::CacheView::Events).
    pub fn apply_kv_events(
        &mut self,
        instance: i64,
        seq: u64,
        batch: &EventBatch,
        replayed: bool,
        source_rank: Option<u32>,
    ) -> Result<Applied> {
        let i = self.check_instance(instance)?;
        let applied =
            self.events_mut()?.apply(i, seq, batch, replayed, source_rank).map_err(Error::InvalidArgument)?;
        if applied.reset {
            self.cache.lock().clear_instance(i); // a restarted engine holds nothing
        }
        if applied.degraded {
            self.estimate_from_events(i);
        }
        Ok(applied)
    }

    /// The estimate takes over `i`'s routing from the blocks its events view held last (the
    /// estimate is not kept while the events view is read).
    fn estimate_from_events(&mut self, i: usize) {
        let Some(keys) = self.events.as_mut().and_then(|e| e.take_dropped(i)) else {
            return; // not newly degraded: the estimate already routes it
        };
        let mut cache = self.cache.lock();
        cache.clear_instance(i);
        let none = PrefixWalk::default();
        for key in keys {
            cache.touch_request(i, &[key], &none);
        }
    }

    /// `instance`'s `rank` missed batches that cannot be replayed: its view turns degraded
    /// and takes the next batch as a new start (docs/kv-events.md).
    pub fn kv_resync(&mut self, instance: i64, rank: u32, reason: &str) -> Result<()> {
        let i = self.check_instance(instance)?;
        self.events_mut()?.resync(i, rank, reason.to_string()).map_err(Error::InvalidArgument)?;
        self.estimate_from_events(i);
        Ok(())
    }

    /// `instance`'s engine restarted: drop its events view (and estimate) until its sequence
    /// 0 comes.
    pub fn kv_reset(&mut self, instance: i64) -> Result<()> {
        let i = self.check_instance(instance)?;
        self.events_mut()?.reset(i);
        self.cache.lock().clear_instance(i);
        Ok(())
    }

    /// `instance`'s events view, or `None` with the estimate view.
    pub fn kv_view(&self, instance: i64) -> Result<Option<ViewReport>> {
        let i = self.check_instance(instance)?;
        Ok(self.events.as_ref().map(|e| e.report(i)))
    }

    /// The events view, if the router has one (for inspection and memory accounting).
    pub fn event_view(&self) -> Option<&EventView> {
        self.events.as_ref()
    }

    fn events_mut(&mut self) -> Result<&mut EventView> {
        self.events
            .as_mut()
            .ok_or_else(|| Error::InvalidArgument("KV events need a router with cache_view='events'".into()))
    }
}

/// Per instance, the events view's match where routing reads it, else the estimate's
/// (`estimate` may be empty when every instance reads the events view).
pub(super) fn merge(out: &mut Vec<u32>, events: &[u32], estimate: &[u32], on_events: impl Fn(usize) -> bool) {
    out.clear();
    out.extend(events.iter().enumerate().map(|(i, &m)| {
        if on_events(i) {
            m
        } else {
            estimate.get(i).copied().unwrap_or(0)
        }
    }));
}
