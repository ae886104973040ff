//! The events view inside the router: keys, removals, copies, cursors, trust, predictions.

use std::time::Duration;

use super::{EventBatch, KvEvent, Outcome, StoredBlocks, ViewState};
use crate::keys::block_hashes_u32;
use crate::{CacheRule, CacheView, Id, Policy, Router, RouterConfig};

const BS: u64 = 4;

fn router(n: usize, ttl_ms: u64) -> Router {
    let config = RouterConfig {
        block_size: BS,
        cache_rule: CacheRule::Vllm,
        cache_view: CacheView::Events,
        pending_ttl: Duration::from_millis(ttl_ms),
        ..RouterConfig::default()
    };
    Router::new(n, Policy::Lmetric, config).unwrap()
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    KvEvent::Stored(StoredBlocks {
        hashes: hashes.to_vec(),
        parent,
        token_ids: tokens.to_vec(),
        block_size: BS as u32,
        ignored: None,
    })
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::Removed { hashes: hashes.to_vec(), ignored: None }
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch { ts: 0.0, events, rank: 0 }
}

fn apply(r: &mut Router, inst: i64, seq: u64, events: Vec<KvEvent>) -> Outcome {
    r.apply_kv_events(inst, seq, &batch(events), false, None).unwrap().outcome
}

/// Tokens 0..n and the hits a request of them would get on each instance.
fn hits(r: &Router, n: u32) -> Vec<u64> {
    let tokens: Vec<u32> = (0..n).collect();
    r.estimate_cache_hits(&block_hashes_u32(&tokens, BS as usize), u64::from(n))
}

#[test]
fn stored_blocks_are_keyed_like_their_tokens() {
    let mut r = router(2, 0);
    let t: Vec<u32> = (0..12).collect();
    assert_eq!(
        apply(&mut r, 1, 0, vec![stored(&[10, 11], None, &t[..8]), stored(&[12], Some(11), &t[8..])]),
        Outcome::Applied
    );
    assert_eq!(hits(&r, 13), vec![0, 12]);
    assert_eq!(hits(&r, 12), vec![0, 8]); // the last token is always recomputed
    assert_eq!(r.state()[1].cached_blocks, 3);
    apply(&mut r, 1, 1, vec![removed(&[12])]);
    assert_eq!(hits(&r, 13), vec![0, 8]);
    apply(&mut r, 1, 2, vec![KvEvent::Cleared]);
    assert_eq!(hits(&r, 13), vec![0, 0]);
}

#[test]
fn a_hash_stored_twice_stays_until_removed_twice() {
    let mut r = router(1, 0);
    let t: Vec<u32> = (0..4).collect();
    apply(&mut r, 0, 0, vec![stored(&[7], None, &t), stored(&[7], None, &t)]);
    apply(&mut r, 0, 1, vec![removed(&[7])]);
    assert_eq!(hits(&r, 5), vec![4]);
    apply(&mut r, 0, 2, vec![removed(&[7]), removed(&[7])]); // the second is unknown
    assert_eq!(hits(&r, 5), vec![0]);
    assert_eq!(r.kv_view(0).unwrap().unwrap().ranks[0].unknown_removals, 1);
}

#[test]
fn gaps_duplicates_and_restarts() {
    let mut r = router(1, 0);
    let t: Vec<u32> = (0..4).collect();
    assert_eq!(apply(&mut r, 0, 3, vec![]), Outcome::Gap { expected: 0 }); // joined late
    assert!(!r.event_view().unwrap().uses_events(0));
    assert_eq!(apply(&mut r, 0, 0, vec![stored(&[1], None, &t)]), Outcome::Applied);
    assert_eq!(apply(&mut r, 0, 2, vec![]), Outcome::Gap { expected: 1 });
    let replay = |r: &mut Router, seq| r.apply_kv_events(0, seq, &batch(vec![]), true, None).unwrap().outcome;
    assert_eq!(replay(&mut r, 0), Outcome::Duplicate);
    assert_eq!(replay(&mut r, 1), Outcome::Applied);
    assert_eq!(apply(&mut r, 0, 2, vec![]), Outcome::Applied);
    assert_eq!(hits(&r, 5), vec![4]);
    // Live sequence 0 again: the engine restarted, its old blocks are gone.
    let got = r.apply_kv_events(0, 0, &batch(vec![]), false, None).unwrap();
    assert_eq!((got.outcome, got.reset), (Outcome::Applied, true));
    assert_eq!(hits(&r, 5), vec![0]);
    assert!(r.event_view().unwrap().uses_events(0));
}

#[test]
fn an_unrepairable_view_degrades_until_cleared() {
    let mut r = router(1, 0);
    let t: Vec<u32> = (0..8).collect();
    apply(&mut r, 0, 0, vec![stored(&[1], None, &t[..4])]);
    r.route(Id::Int(1), &block_hashes_u32(&t, 4), 8, None).unwrap(); // pending there: not confirmed
    let got = r.apply_kv_events(0, 1, &batch(vec![stored(&[3], Some(99), &t[4..])]), false, None).unwrap();
    assert!(got.degraded);
    let view = r.kv_view(0).unwrap().unwrap();
    assert!(matches!(&view.ranks[0].state, ViewState::Degraded(why) if why.contains("parent")));
    assert!(!view.uses_events);
    assert_eq!(hits(&r, 9), vec![4], "routed on the estimate, from the events view's last blocks");
    apply(&mut r, 0, 2, vec![stored(&[1], None, &t[..4])]);
    apply(&mut r, 0, 3, vec![KvEvent::Cleared, stored(&[5], None, &t[..4])]);
    assert!(r.kv_view(0).unwrap().unwrap().uses_events);
    assert_eq!(hits(&r, 9), vec![4]);
    // A gap that cannot be replayed: degraded, and the next batch is taken as a new start.
    assert_eq!(apply(&mut r, 0, 9, vec![]), Outcome::Gap { expected: 4 });
    r.kv_resync(0, 0, "no replay socket").unwrap();
    assert_eq!(apply(&mut r, 0, 9, vec![]), Outcome::Applied);
    assert_eq!(r.kv_view(0).unwrap().unwrap().ranks[0].state, ViewState::Degraded("no replay socket".into()));
}

#[test]
fn a_batch_naming_another_rank_than_its_source_is_refused() {
    let mut r = router(1, 0);
    let t: Vec<u32> = (0..4).collect();
    let on = |r: &mut Router, seq, rank, events| {
        r.apply_kv_events(0, seq, &EventBatch { ts: 0.0, events, rank }, false, Some(0)).unwrap().outcome
    };
    assert_eq!(on(&mut r, 0, 0, vec![stored(&[1], None, &t)]), Outcome::Applied);
    assert_eq!(on(&mut r, 1, 7, vec![KvEvent::Cleared]), Outcome::Foreign);
    let view = r.kv_view(0).unwrap().unwrap();
    assert_eq!(view.ranks.len(), 1, "no view of the foreign rank");
    assert_eq!((view.ranks[0].foreign_batches, view.ranks[0].last_seq), (1, Some(1)));
    assert!(view.uses_events);
    assert_eq!(hits(&r, 5), vec![4], "its events were not applied");
    // The source's next batch follows on: the foreign one took the source's number 1.
    assert_eq!(on(&mut r, 2, 0, vec![]), Outcome::Applied);
    assert_eq!(on(&mut r, 3, 0, vec![KvEvent::Cleared]), Outcome::Applied);
    assert_eq!(hits(&r, 5), vec![0]);
}

#[test]
fn a_rank_without_a_source_makes_no_view_before_its_start() {
    // A stray batch of rank 7 (not its sequence 0): a gap, and instance 0 stays on its events.
    let mut r = router(1, 0);
    let t: Vec<u32> = (0..4).collect();
    assert_eq!(apply(&mut r, 0, 0, vec![stored(&[1], None, &t)]), Outcome::Applied);
    let stray = EventBatch { ts: 0.0, events: vec![KvEvent::Cleared], rank: 7 };
    assert_eq!(r.apply_kv_events(0, 1, &stray, false, None).unwrap().outcome, Outcome::Gap { expected: 0 });
    let view = r.kv_view(0).unwrap().unwrap();
    assert!(view.uses_events && view.ranks.len() == 1);
    assert_eq!(apply(&mut r, 0, 1, vec![KvEvent::Cleared]), Outcome::Applied);
    assert_eq!(hits(&r, 5), vec![0]);
}

#[test]
fn ranks_without_a_source_are_bounded_and_sequences_wrap() {
    let mut r = router(1, 0);
    for rank in 0..super::view::MAX_RANKS as u32 {
        r.apply_kv_events(0, 0, &EventBatch { ts: 0.0, events: vec![], rank }, false, None).unwrap();
    }
    let more = EventBatch { ts: 0.0, events: vec![], rank: 5000 };
    let err = r.apply_kv_events(0, 0, &more, false, None).unwrap_err().to_string();
    assert!(err.contains("rank 5000 is refused"), "{err}");
    assert_eq!(r.kv_view(0).unwrap().unwrap().ranks.len(), super::view::MAX_RANKS);
    let mut r = router(1, 0);
    assert_eq!(apply(&mut r, 0, 0, vec![]), Outcome::Applied);
    r.kv_resync(0, 0, "test").unwrap();
    assert_eq!(apply(&mut r, 0, u64::MAX, vec![]), Outcome::Applied);
    assert_eq!(apply(&mut r, 0, 0, vec![]), Outcome::Applied, "2^64-1 is followed by 0");
}

#[test]
fn a_block_size_other_than_the_routers_degrades() {
    let mut r = router(1, 0);
    let event = KvEvent::Stored(StoredBlocks {
        hashes: vec![1],
        parent: None,
        token_ids: vec![0; 8],
        block_size: 8,
        ignored: None,
    });
    assert!(r.apply_kv_events(0, 0, &batch(vec![event]), false, None).unwrap().degraded);
}

#[test]
fn routed_blocks_are_pending_until_confirmed_or_expired() {
    let mut r = router(2, 30);
    apply(&mut r, 0, 0, vec![]);
    apply(&mut r, 1, 0, vec![]);
    let t: Vec<u32> = (0..9).collect();
    let keys = block_hashes_u32(&t, 4);
    let first = r.route(Id::Int(1), &keys, 9, None).unwrap().instance;
    let mut expect = vec![0, 0];
    expect[first] = 8;
    assert_eq!(hits(&r, 9), expect, "pending on the instance chosen");
    // The engine confirms the first block; the second expires unconfirmed.
    apply(&mut r, first as i64, 1, vec![stored(&[5], None, &t[..4])]);
    std::thread::sleep(Duration::from_millis(40));
    r.route(Id::Int(2), &keys[..1], 3, None).unwrap(); // expiry runs on the next route
    expect[first] = 4;
    assert_eq!(hits(&r, 9), expect);
    assert_eq!(r.kv_view(first as i64).unwrap().unwrap().pending, 0);
}

#[test]
fn a_rank_holds_at_most_twice_its_engines_capacity() {
    let mut r = router(1, 0);
    apply(&mut r, 0, 0, vec![]);
    r.set_cache_capacity(0, Some(600)).unwrap(); // after the rank's view was made
    let limit = super::engine::max_blocks(600);
    assert_eq!(limit, 1200);
    // Stores with no removals: one block too many turns the view degraded, its blocks gone.
    let tokens: Vec<u32> = (0..(limit as u32 + 1) * 4).collect();
    let hashes: Vec<u64> = (1..=limit as u64 + 1).collect();
    let got = r
        .apply_kv_events(
            0,
            1,
            &batch(vec![stored(&hashes[..limit], None, &tokens[..limit * 4])]),
            false,
            None,
        )
        .unwrap();
    assert!(!got.degraded);
    let last = stored(&hashes[limit..], Some(hashes[limit - 1]), &tokens[limit * 4..]);
    assert!(r.apply_kv_events(0, 2, &batch(vec![last]), false, None).unwrap().degraded);
    let view = r.kv_view(0).unwrap().unwrap();
    assert!(matches!(&view.ranks[0].state, ViewState::Degraded(why) if why.contains("missed removals")));
    assert_eq!(view.ranks[0].blocks_indexed, 0);
}

#[test]
fn memory_comes_back_after_a_clear() {
    let mut r = router(1, 0);
    let n = 50_000u32;
    let tokens: Vec<u32> = (0..n * 4).collect();
    let hashes: Vec<u64> = (1..=u64::from(n)).collect();
    apply(&mut r, 0, 0, vec![stored(&hashes, None, &tokens)]);
    let full = r.event_view().unwrap().memory_bytes();
    assert!(full > 50_000 * 20, "{full}");
    apply(&mut r, 0, 1, vec![KvEvent::Cleared]);
    let cleared = r.event_view().unwrap().memory_bytes();
    assert!(cleared < full / 20, "{cleared} of {full}");
}

#[test]
fn replicas_with_shared_affinity_agree_on_sessions() {
    let config = RouterConfig {
        block_size: BS,
        cache_rule: CacheRule::Vllm,
        cache_view: CacheView::Events,
        shared_affinity: true,
        ..RouterConfig::default()
    };
    let mut replicas: Vec<Router> =
        (0..2).map(|_| Router::new(3, Policy::Unified, config.clone()).unwrap()).collect();
    for r in &mut replicas {
        for i in 0..3 {
            apply(r, i, 0, vec![]);
        }
    }
    let t: Vec<u32> = (0..13).collect();
    let session = Id::Str("s".into());
    // Turn 1 through replica 0; its engine stores the prompt's blocks; both replicas see it.
    let first = replicas[0].route(Id::Int(1), &block_hashes_u32(&t[..9], 4), 9, Some(&session)).unwrap();
    replicas[0].finish(&Id::Int(1));
    for r in &mut replicas {
        apply(r, first.instance as i64, 1, vec![stored(&[1, 2], None, &t[..8])]);
    }
    // Turn 2 through replica 1, which never saw the session: where its prefix is.
    let second = replicas[1].route(Id::Int(2), &block_hashes_u32(&t, 4), 13, Some(&session)).unwrap();
    assert_eq!(second.instance, first.instance);
    // With sticky (affinity without a gate), new sessions with nothing cached: the same
    // instance from either replica, though their own counts differ, and spread.
    let mut replicas: Vec<Router> =
        (0..2).map(|_| Router::new(3, Policy::Sticky, config.clone()).unwrap()).collect();
    for n in 0..4 {
        replicas[1].route(Id::Int(100 + n), &[], 500, None).unwrap();
    }
    let mut chosen = Vec::new();
    for n in 0..30 {
        let keys = block_hashes_u32(&[90 + n, 91, 92, 93, 94], 4);
        let new = Id::Int(1000 + i64::from(n));
        let a = replicas[0].route(Id::Int(200 + i64::from(n)), &keys, 5, Some(&new)).unwrap().instance;
        let b = replicas[1].route(Id::Int(200 + i64::from(n)), &keys, 5, Some(&new)).unwrap().instance;
        assert_eq!(a, b, "session {n}");
        chosen.push(a);
    }
    assert!((0..3).all(|i| chosen.contains(&i)), "{chosen:?}");
}
