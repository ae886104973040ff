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
    r.apply_kv_events(inst, seq, &batch(events), false).unwrap().outcome
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
    let replay = |r: &mut Router, seq| r.apply_kv_events(0, seq, &batch(vec![]), true).unwrap().outcome;
    assert_eq!(replay(&mut r, 0), Outcome::Duplicate);
    assert_eq!(replay(&mut r, 1), Outcome::Applied);
    assert_eq!(apply(&mut r, 0, 2, vec![]), Outcome::Applied);
    assert_eq!(hits(&r, 5), vec![4]);
    // Live sequence 0 again: the engine restarted, its old blocks are gone.
    let got = r.apply_kv_events(0, 0, &batch(vec![]), false).unwrap();
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
    let got = r.apply_kv_events(0, 1, &batch(vec![stored(&[3], Some(99), &t[4..])]), false).unwrap();
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
fn a_block_size_other_than_the_routers_degrades() {
    let mut r = router(1, 0);
    let event = KvEvent::Stored(StoredBlocks {
        hashes: vec![1],
        parent: None,
        token_ids: vec![0; 8],
        block_size: 8,
        ignored: None,
    });
    assert!(r.apply_kv_events(0, 0, &batch(vec![event]), false).unwrap().degraded);
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
