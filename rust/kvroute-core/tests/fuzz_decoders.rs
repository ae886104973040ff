//! Property tests (proptest) of the decoders that read bytes from outside the process: the
//! KV-event batch decoder (`events::decode`), the completions prompt scan (`prompt_scan`)
//! and the relay's body keying (`relay::body`). On any bytes, random or damaged valid ones,
//! they return a value or an error and never panic, loop or allocate without bound; on valid
//! input they return exactly what was encoded. The case count is bounded (`FUZZ_CASES`,
//! default 2,000 per property) so the file runs in seconds; set `PROPTEST_CASES` for more.

use kvroute_core::events::decode::decode_batch;
use kvroute_core::events::{EventBatch, KvEvent, StoredBlocks};
use kvroute_core::keys::block_hashes_u32;
use kvroute_core::prompt_scan::prompt_ids;
use kvroute_core::relay::body::token_prompt;
use kvroute_core::Id;
use proptest::prelude::*;
use rmp::encode as mp;

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(2000);
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

// ---- KV events: msgpack batches -----------------------------------------------------------

fn event() -> impl Strategy<Value = KvEvent> {
    let stored = (1u32..5, prop::collection::vec(any::<u64>(), 0..4), prop::option::of(any::<u64>()))
        .prop_flat_map(|(block_size, hashes, parent)| {
            let n = hashes.len() * block_size as usize;
            prop::collection::vec(any::<u32>(), n..=n).prop_map(move |token_ids| {
                KvEvent::Stored(StoredBlocks {
                    hashes: hashes.clone(),
                    parent,
                    token_ids,
                    block_size,
                    ignored: None,
                })
            })
        });
    let removed = prop::collection::vec(any::<u64>(), 0..4)
        .prop_map(|hashes| KvEvent::Removed { hashes, ignored: None });
    prop_oneof![stored, removed, Just(KvEvent::Cleared)]
}

fn batch() -> impl Strategy<Value = EventBatch> {
    (-1e12f64..1e12, prop::collection::vec(event(), 0..5), 0u32..8)
        .prop_map(|(ts, events, rank)| EventBatch { ts, events, rank })
}

fn put_u64s(out: &mut Vec<u8>, values: &[u64]) {
    mp::write_array_len(out, values.len() as u32).unwrap();
    for &v in values {
        mp::write_uint(out, v).unwrap();
    }
}

/// vLLM's encodings of a batch: events as maps (`map`) or as tagged arrays.
fn encode(b: &EventBatch, map: bool) -> Vec<u8> {
    let mut out = Vec::new();
    mp::write_array_len(&mut out, 3).unwrap();
    mp::write_f64(&mut out, b.ts).unwrap();
    mp::write_array_len(&mut out, b.events.len() as u32).unwrap();
    for e in &b.events {
        let (tag, fields) = match e {
            KvEvent::Stored(_) => ("BlockStored", 6),
            KvEvent::Removed { .. } => ("BlockRemoved", 2),
            KvEvent::Cleared => ("AllBlocksCleared", 0),
        };
        let key = |out: &mut Vec<u8>, name: &str| {
            if map {
                mp::write_str(out, name).unwrap();
            }
        };
        if map {
            mp::write_map_len(&mut out, fields + 1).unwrap();
            mp::write_str(&mut out, "type").unwrap();
        } else {
            mp::write_array_len(&mut out, fields + 1).unwrap();
        }
        mp::write_str(&mut out, tag).unwrap();
        match e {
            KvEvent::Stored(s) => {
                key(&mut out, "block_hashes");
                put_u64s(&mut out, &s.hashes);
                key(&mut out, "parent_block_hash");
                match s.parent {
                    Some(p) => mp::write_uint(&mut out, p).map(|_| ()).unwrap(),
                    None => mp::write_nil(&mut out).unwrap(),
                }
                key(&mut out, "token_ids");
                mp::write_array_len(&mut out, s.token_ids.len() as u32).unwrap();
                for &t in &s.token_ids {
                    mp::write_uint(&mut out, u64::from(t)).unwrap();
                }
                key(&mut out, "block_size");
                mp::write_uint(&mut out, u64::from(s.block_size)).unwrap();
                key(&mut out, "lora_id");
                mp::write_nil(&mut out).unwrap();
                key(&mut out, "medium");
                mp::write_str(&mut out, "GPU").unwrap();
            }
            KvEvent::Removed { hashes, .. } => {
                key(&mut out, "block_hashes");
                put_u64s(&mut out, hashes);
                key(&mut out, "medium");
                mp::write_str(&mut out, "GPU").unwrap();
            }
            KvEvent::Cleared => {}
        }
    }
    mp::write_uint(&mut out, u64::from(b.rank)).unwrap();
    out
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn events_valid_batches_decode_to_what_was_encoded(b in batch(), map in any::<bool>()) {
        prop_assert_eq!(decode_batch(&encode(&b, map)), Ok(b));
    }

    #[test]
    fn events_any_bytes_give_a_batch_or_an_error(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn events_damaged_batches_give_a_batch_or_an_error(
        b in batch(),
        map in any::<bool>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = encode(&b, map);
        for (at, x) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= x;
        }
        let _ = decode_batch(&bytes);
        let _ = decode_batch(&bytes[..cut.index(bytes.len() + 1)]);
    }
}

#[test]
fn events_deep_nesting_and_huge_lengths_are_errors() {
    // An unknown field holding 1M nested arrays: skipped without recursion.
    let mut deep = vec![0x93, 0xcb];
    deep.extend(0f64.to_be_bytes());
    deep.extend([0x91, 0x82, 0xa4]);
    deep.extend(b"type");
    deep.extend([0xa4]);
    deep.extend(b"nope");
    deep.extend([0xa1, b'x']);
    deep.extend(std::iter::repeat_n(0x91, 1 << 20));
    deep.push(0xc0);
    deep.push(0x00);
    assert!(decode_batch(&deep).is_err());
    // Lengths of 2**32 - 1 items with nothing behind them.
    for marker in [0xdd_u8, 0xdf] {
        let mut huge = vec![0x93, 0xcb];
        huge.extend(0f64.to_be_bytes());
        huge.extend([0x91, 0x81, 0xa1, b'x', marker, 0xff, 0xff, 0xff, 0xff]);
        assert!(decode_batch(&huge).is_err());
    }
}

// ---- the relay's body keying ---------------------------------------------------------------

fn json_scalar() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("null".to_string()),
        Just("true".to_string()),
        any::<i32>().prop_map(|v| v.to_string()),
        "[a-z ]{0,6}".prop_map(|s| format!("\"{s}\"")),
        Just("[1, {\"a\": [2]}, \"x\"]".to_string()),
    ]
}

/// A completions body: `prompt` ids, `stream`, a session field, other fields, and the
/// whitespace between tokens.
#[derive(Debug, Clone)]
struct Body {
    ids: Vec<u32>,
    stream: bool,
    session: Option<i64>,
    extra: Vec<(String, String)>,
    ws: &'static str,
}

fn body() -> impl Strategy<Value = Body> {
    (
        prop::collection::vec(any::<u32>(), 1..200),
        any::<bool>(),
        prop::option::of(any::<i64>()),
        prop::collection::vec(("[a-z]{1,6}", json_scalar()), 0..4),
        prop::sample::select(vec!["", " ", "\n\t "]),
    )
        .prop_map(|(ids, stream, session, extra, ws)| Body { ids, stream, session, extra, ws })
}

impl Body {
    fn render(&self) -> String {
        let ws = self.ws;
        let ids = self.ids.iter().map(u32::to_string).collect::<Vec<_>>().join(&format!(",{ws}"));
        let mut fields = vec![
            format!("\"model\":{ws}\"m\""),
            format!("\"prompt\":{ws}[{ids}]"),
            format!("\"stream\":{ws}{}", self.stream),
        ];
        if let Some(s) = self.session {
            fields.push(format!("\"session_id\":{ws}{s}"));
        }
        for (k, v) in &self.extra {
            fields.push(format!("\"k{k}\":{ws}{v}")); // "k..." never names a field read
        }
        format!("{{{ws}{}{ws}}}", fields.join(&format!(",{ws}")))
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn body_valid_bodies_are_keyed_exactly(b in body(), bs in 1usize..64) {
        let text = b.render();
        let scan = prompt_ids(text.as_bytes()).expect("a plain token prompt is found");
        prop_assert_eq!(&scan.ids, &b.ids);
        let keyed = token_prompt(text.as_bytes(), bs, Some("session_id"), None).expect("keyed in Rust");
        prop_assert_eq!(keyed.keys, block_hashes_u32(&b.ids, bs));
        prop_assert_eq!(keyed.input_length, b.ids.len() as u64);
        prop_assert_eq!(keyed.stream, b.stream);
        prop_assert_eq!(keyed.session, b.session.map(Id::Int));
    }

    #[test]
    fn body_any_bytes_are_keyed_or_left_to_the_parser(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = prompt_ids(&bytes);
        let _ = token_prompt(&bytes, 16, Some("session_id"), Some("s"));
    }

    #[test]
    fn body_damaged_bodies_never_misread_the_prompt(
        b in body(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = b.render().into_bytes();
        for (at, x) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= x;
        }
        for damaged in [&bytes[..], &bytes[..cut.index(bytes.len() + 1)]] {
            if let Some(scan) = prompt_ids(damaged) {
                // Whatever was found is a plain array of ids inside the body.
                prop_assert!(scan.start < scan.end && scan.end <= damaged.len());
                prop_assert_eq!(damaged[scan.start], b'[');
                prop_assert_eq!(damaged[scan.end - 1], b']');
            }
            if let Some(k) = token_prompt(damaged, 8, Some("session_id"), None) {
                prop_assert!(k.input_length > 0);
                prop_assert_eq!(k.keys.len() as u64, k.input_length.div_ceil(8));
            }
        }
    }
}

#[test]
fn body_deep_nesting_is_left_to_the_parser() {
    let deep = format!("{{\"prompt\": [1, 2], \"x\": {}1{}}}", "[".repeat(1 << 20), "]".repeat(1 << 20));
    assert!(token_prompt(deep.as_bytes(), 16, None, None).is_none());
    let _ = prompt_ids(deep.as_bytes());
}
