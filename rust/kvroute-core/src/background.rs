//! The router's cache model, touched in place or by one background worker thread.
//!
//! In place (the default) a route touches the chosen instance's keys before it returns. With a
//! worker ([`CacheCell::start_worker`]) it hands that touch (its keys and the walk's entries)
//! to the worker and returns at once; every later read or write of the cache first waits until
//! the worker has applied every touch handed to it, so operations happen in the same order as
//! in place and every result is identical. This pays off when the caller has other work
//! between routes (the simulator's engines) and a core to spare: the worker spins (then
//! yields) while it waits for work, so it keeps a core busy for the life of the router.
//!
//! Handing off costs a copy of the request's keys. Thread-safety: the cache sits behind a
//! mutex shared with the worker; submissions come from the one thread that owns the router.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use crate::cache::{ClusterCache, PrefixWalk};

/// Idle polls before the worker starts yielding its core between polls.
const SPINS_BEFORE_YIELD: u32 = 1 << 12;

struct Touch {
    inst: usize,
    keys: Vec<u64>,
    walk: PrefixWalk,
}

/// A value on cache lines of its own, so that one thread writing it does not slow down the
/// other thread's reads of its neighbours (each field below is written by one side and
/// polled or used by the other).
#[derive(Default)]
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

#[derive(Default)]
struct Shared {
    cache: Padded<Mutex<ClusterCache>>,
    touches: Padded<Mutex<VecDeque<Touch>>>,
    submitted: Padded<AtomicU64>,
    done: Padded<AtomicU64>,
    stop: AtomicBool,
    failed: AtomicBool,
}

impl Shared {
    fn cache(&self) -> MutexGuard<'_, ClusterCache> {
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The cache model and, optionally, the worker that applies its touches.
pub(crate) struct CacheCell {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl CacheCell {
    pub fn new(cache: ClusterCache) -> Self {
        Self {
            shared: Arc::new(Shared { cache: Padded(Mutex::new(cache)), ..Shared::default() }),
            worker: None,
        }
    }

    /// Apply touches on a worker thread from now on (no-op if one runs already).
    pub fn start_worker(&mut self) {
        if self.worker.is_none() {
            let shared = Arc::clone(&self.shared);
            self.worker = Some(std::thread::spawn(move || work(&shared)));
        }
    }

    /// The cache, once every touch handed to the worker has been applied.
    ///
    /// # Panics
    /// If the worker panicked (the cache model is then unknown).
    #[inline]
    pub fn lock(&self) -> MutexGuard<'_, ClusterCache> {
        let s = &self.shared;
        let mut polls = 0u32;
        while s.done.load(Ordering::Acquire) < s.submitted.load(Ordering::Relaxed) {
            assert!(!s.failed.load(Ordering::Acquire), "the cache worker thread panicked");
            polls += 1;
            if polls < SPINS_BEFORE_YIELD {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        s.cache()
    }

    /// Touch `keys` on `inst` (see [`ClusterCache::touch_request`]), in place or on the worker.
    /// The walk's entries are consumed.
    #[inline]
    pub fn touch(&self, inst: usize, keys: &[u64], walk: &mut PrefixWalk) {
        if self.worker.is_none() {
            self.lock().touch_request(inst, keys, walk);
            return;
        }
        let touch = Touch { inst, keys: keys.to_vec(), walk: walk.take_entries() };
        let s = &self.shared;
        s.touches.lock().unwrap_or_else(PoisonError::into_inner).push_back(touch);
        s.submitted.fetch_add(1, Ordering::Release);
    }
}

fn work(s: &Shared) {
    let (mut taken, mut polls) = (0u64, 0u32);
    loop {
        if s.submitted.load(Ordering::Acquire) == taken {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            polls += 1;
            if polls < SPINS_BEFORE_YIELD {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
            continue;
        }
        polls = 0;
        let touch = s.touches.lock().unwrap_or_else(PoisonError::into_inner).pop_front();
        let Some(t) = touch else { continue };
        taken += 1;
        let applied = catch_unwind(AssertUnwindSafe(|| s.cache().touch_request(t.inst, &t.keys, &t.walk)));
        if applied.is_err() {
            s.failed.store(true, Ordering::Release);
            return;
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

impl Drop for CacheCell {
    fn drop(&mut self) {
        if let Some(worker) = self.worker.take() {
            self.shared.stop.store(true, Ordering::Release);
            // A worker that panicked has already reported it through `failed`.
            let _ = worker.join();
        }
    }
}

impl Clone for CacheCell {
    /// A copy of the cache as it stands, touched in place.
    fn clone(&self) -> Self {
        Self::new(self.lock().clone())
    }
}

impl std::fmt::Debug for CacheCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheCell").field("worker", &self.worker.is_some()).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use crate::rng::SplitMix64;
    use crate::{Id, Policy, Router, RouterConfig};

    /// The same random requests through a router that touches in place and one that touches
    /// in the background: equal decisions, states and cache contents at every step.
    #[test]
    fn background_touches_give_the_same_router() {
        let config = RouterConfig { cache_capacity_blocks: Some(20), ..RouterConfig::default() };
        let mut a = Router::new(4, Policy::Unified, config.clone()).unwrap();
        let mut b = Router::new(4, Policy::Unified, config).unwrap();
        b.touch_in_background();
        let mut rng = SplitMix64::new(11);
        for r in 0..3000i64 {
            let session = Id::Int(rng.below(30) as i64);
            let keys: Vec<u64> = (0..1 + rng.below(12)).map(|j| (rng.below(4) * 100 + j) as u64).collect();
            let n = keys.len() as u64 * 512;
            let da = a.route(Id::Int(r), &keys, n, Some(&session)).unwrap();
            let db = b.route(Id::Int(r), &keys, n, Some(&session)).unwrap();
            assert_eq!(da, db);
            if r >= 8 {
                assert!(a.finish(&Id::Int(r - 8)) && b.finish(&Id::Int(r - 8)));
            }
            assert_eq!(a.state(), b.state());
        }
        for i in 0..4 {
            assert_eq!(a.cached_keys(i).unwrap(), b.cached_keys(i).unwrap());
        }
    }
}
