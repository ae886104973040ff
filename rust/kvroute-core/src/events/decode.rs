//! Decoding of one published batch: the third frame of vLLM's `[topic, seq, payload]`
//! messages, msgpack of `[ts, [event, ...], data_parallel_rank]`.
//!
//! Events are tagged structs; vLLM has encoded them as maps with a `"type"` field (0.9 and
//! later: `{"type": "BlockStored", "block_hashes": [...], ...}`) and as arrays whose first
//! element is the tag (`["BlockStored", block_hashes, parent_block_hash, token_ids, ...]`,
//! fields in declaration order, trailing defaults omitted). Both are read. Block hashes are
//! integers (vLLM's default) or bytes (sha256 digests), which are folded to 64 bits with xxh3.
//! Unknown fields are skipped; a field of the wrong type is an error naming the event and
//! the field.
//!
//! The msgpack markers are read with the `rmp` crate. O(payload bytes); pure, thread-safe.

use rmp::decode::{self as mp, RmpRead};
use rmp::Marker;
use xxhash_rust::xxh3::xxh3_64;

use super::{EventBatch, KvEvent, StoredBlocks};

/// Why a payload is not a batch: what was wrong and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

type Res<T> = std::result::Result<T, String>;

/// An `rmp` error as text.
fn debug(e: impl std::fmt::Debug) -> String {
    format!("{e:?}")
}

/// Field names of the array encoding, by position after the tag (vLLM's declaration order).
const STORED_FIELDS: [&str; 9] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

/// Decode one batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut rd = payload;
    let whole = payload.len();
    let at = |rd: &[u8]| whole - rd.len();
    let batch = read_batch(&mut rd).map_err(|e| DecodeError(format!("{e} (at byte {})", at(rd))))?;
    if !rd.is_empty() {
        return Err(DecodeError(format!("{} bytes after the batch", rd.len())));
    }
    Ok(batch)
}

fn read_batch(rd: &mut &[u8]) -> Res<EventBatch> {
    let n = array_len(rd).map_err(|e| format!("batch: {e}"))?;
    if !(2..=3).contains(&n) {
        return Err(format!("batch: expected [ts, events, rank], got an array of {n}"));
    }
    let ts = float(rd).map_err(|e| format!("batch ts: {e}"))?;
    let count = array_len(rd).map_err(|e| format!("batch events: {e}"))?;
    let mut events = Vec::with_capacity(count.min(1 << 16) as usize);
    for i in 0..count {
        events.push(read_event(rd).map_err(|e| format!("event {i}: {e}"))?);
    }
    let rank = if n == 3 { opt_int(rd).map_err(|e| format!("batch rank: {e}"))?.unwrap_or(0) } else { 0 };
    let rank = u32::try_from(rank).map_err(|_| format!("batch rank: {rank} is not a rank"))?;
    Ok(EventBatch { ts, events, rank })
}

/// The fields of one event as they are read, whichever the encoding.
#[derive(Default)]
struct Fields {
    hashes: Vec<u64>,
    parent: Option<u64>,
    token_ids: Vec<u32>,
    block_size: Option<u64>,
    ignored: Option<&'static str>,
}

impl Fields {
    fn read(&mut self, name: &str, rd: &mut &[u8]) -> Res<()> {
        let field = |e: String| format!("field {name}: {e}");
        match name {
            "block_hashes" => self.hashes = hashes(rd).map_err(field)?,
            "parent_block_hash" => self.parent = if nil(rd) { None } else { Some(hash(rd).map_err(field)?) },
            "token_ids" => self.token_ids = token_ids(rd).map_err(field)?,
            "block_size" => self.block_size = Some(int(rd).map_err(field)? as u64),
            "lora_id" | "lora_name" => self.ignore_unless_nil(rd, "a LoRA adapter's blocks"),
            "medium" => {
                if !nil(rd) {
                    let medium = string(rd).map_err(field)?;
                    if medium != "GPU" {
                        self.ignored = self.ignored.or(Some("blocks on a medium other than the GPU"));
                    }
                }
            }
            "extra_keys" => {
                if !nil(rd) {
                    let n = array_len(rd).map_err(field)?;
                    for _ in 0..n {
                        self.ignore_unless_nil(rd, "blocks with extra hash keys");
                    }
                }
            }
            "group_idx" => {
                if opt_int(rd).map_err(field)?.is_some_and(|g| g != 0) {
                    self.ignored = self.ignored.or(Some("blocks of a KV-cache group other than 0"));
                }
            }
            _ => skip(rd).map_err(field)?,
        }
        Ok(())
    }

    /// Skip a value; one that is not nil puts the event outside the view for `why`.
    fn ignore_unless_nil(&mut self, rd: &mut &[u8], why: &'static str) {
        if !nil(rd) {
            self.ignored = self.ignored.or(Some(why));
            // A malformed value fails the next read, so the error is not lost.
            let _ = skip(rd);
        }
    }

    fn into_event(self, tag: &str) -> Res<KvEvent> {
        match tag {
            "BlockStored" => {
                let block_size = self.block_size.ok_or("BlockStored without block_size")?;
                let block_size =
                    u32::try_from(block_size).ok().filter(|&b| b > 0).ok_or("block_size must be positive")?;
                if self.token_ids.len() != self.hashes.len() * block_size as usize {
                    return Err(format!(
                        "BlockStored has {} token ids for {} blocks of {block_size}",
                        self.token_ids.len(),
                        self.hashes.len()
                    ));
                }
                let Fields { hashes, parent, token_ids, ignored, .. } = self;
                Ok(KvEvent::Stored(StoredBlocks { hashes, parent, token_ids, block_size, ignored }))
            }
            "BlockRemoved" => Ok(KvEvent::Removed { hashes: self.hashes, ignored: self.ignored }),
            "AllBlocksCleared" => Ok(KvEvent::Cleared),
            other => Err(format!("unknown event type {other:?}")),
        }
    }
}

fn read_event(rd: &mut &[u8]) -> Res<KvEvent> {
    let marker = mp::read_marker(rd).map_err(debug)?;
    let mut fields = Fields::default();
    match marker {
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
            let n = mp::marker_to_len(rd, marker).map_err(debug)?;
            let mut tag = None;
            for _ in 0..n {
                let name = string(rd)?;
                if name == "type" {
                    tag = Some(string(rd).map_err(|e| format!("field type: {e}"))?);
                } else {
                    fields.read(name, rd)?;
                }
            }
            fields.into_event(tag.ok_or("an event without a \"type\"")?)
        }
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            let n = array_len_after(rd, marker)?;
            if n == 0 {
                return Err("an empty event".into());
            }
            let tag = string(rd).map_err(|e| format!("tag: {e}"))?;
            let names: &[&str] = match tag {
                "BlockStored" => &STORED_FIELDS,
                "BlockRemoved" => &REMOVED_FIELDS,
                _ => &[],
            };
            for pos in 1..n as usize {
                fields.read(names.get(pos - 1).copied().unwrap_or(""), rd)?;
            }
            fields.into_event(tag)
        }
        other => Err(format!("expected a map or an array, got {other:?}")),
    }
}

fn array_len(rd: &mut &[u8]) -> Res<u32> {
    let marker = mp::read_marker(rd).map_err(debug)?;
    array_len_after(rd, marker)
}

fn array_len_after(rd: &mut &[u8], marker: Marker) -> Res<u32> {
    match marker {
        Marker::FixArray(n) => Ok(u32::from(n)),
        Marker::Array16 => rd.read_data_u16().map(u32::from).map_err(debug),
        Marker::Array32 => rd.read_data_u32().map_err(debug),
        other => Err(format!("expected an array, got {other:?}")),
    }
}

/// Consume a nil if one comes next.
fn nil(rd: &mut &[u8]) -> bool {
    let is_nil = rd.first() == Some(&0xc0);
    if is_nil {
        *rd = &rd[1..];
    }
    is_nil
}

fn int(rd: &mut &[u8]) -> Res<i64> {
    mp::read_int::<i64, _>(rd).map_err(|_| "expected an integer".to_string())
}

fn opt_int(rd: &mut &[u8]) -> Res<Option<i64>> {
    if nil(rd) {
        Ok(None)
    } else {
        int(rd).map(Some)
    }
}

fn float(rd: &mut &[u8]) -> Res<f64> {
    match rd.first().copied() {
        Some(0xcb) => mp::read_f64(rd).map_err(debug),
        Some(0xca) => mp::read_f32(rd).map(f64::from).map_err(debug),
        _ => int(rd).map(|i| i as f64).map_err(|_| "expected a number".into()),
    }
}

fn string<'a>(rd: &mut &'a [u8]) -> Res<&'a str> {
    let (s, rest) = mp::read_str_from_slice(*rd).map_err(|e| format!("expected a string: {e:?}"))?;
    *rd = rest;
    Ok(s)
}

/// A block hash: an unsigned 64-bit integer, or bytes folded to 64 bits with xxh3.
fn hash(rd: &mut &[u8]) -> Res<u64> {
    match rd.first().copied() {
        Some(0xc4..=0xc6) => {
            let len = mp::read_bin_len(rd).map_err(debug)? as usize;
            let bytes = take(rd, len)?;
            Ok(xxh3_64(bytes))
        }
        Some(0xd0..=0xd3 | 0xe0..=0xff) => Ok(int(rd)? as u64), // negative: its two's complement
        _ => mp::read_int::<u64, _>(rd).map_err(|_| "expected a block hash (an integer or bytes)".into()),
    }
}

fn hashes(rd: &mut &[u8]) -> Res<Vec<u64>> {
    let n = array_len(rd)?;
    (0..n).map(|_| hash(rd)).collect()
}

fn token_ids(rd: &mut &[u8]) -> Res<Vec<u32>> {
    let n = array_len(rd)?;
    (0..n)
        .map(|i| mp::read_int::<u32, _>(rd).map_err(|_| format!("token {i} is not an id in 0..2**32")))
        .collect()
}

fn take<'a>(rd: &mut &'a [u8], len: usize) -> Res<&'a [u8]> {
    if rd.len() < len {
        return Err(format!("{len} bytes announced, {} left", rd.len()));
    }
    let (head, rest) = rd.split_at(len);
    *rd = rest;
    Ok(head)
}

/// Skip one value of any type.
/// Skip one value, however deeply nested, without recursion: containers add their items to
/// the count of values still to skip.
fn skip(rd: &mut &[u8]) -> Res<()> {
    let mut pending: u64 = 1;
    while pending > 0 {
        pending -= 1;
        pending += skip_head(rd)?;
        if pending > rd.len() as u64 {
            return Err(format!("a container of {pending} values in {} bytes", rd.len()));
        }
    }
    Ok(())
}

/// Skip one value's marker and scalar bytes; returns how many items it contains.
fn skip_head(rd: &mut &[u8]) -> Res<u64> {
    let marker = mp::read_marker(rd).map_err(debug)?;
    let (bytes, items) = match marker {
        Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => (0, 0),
        Marker::U8 | Marker::I8 => (1, 0),
        Marker::U16 | Marker::I16 => (2, 0),
        Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
        Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
        Marker::FixStr(n) => (usize::from(n), 0),
        Marker::Str8 | Marker::Bin8 => (usize::from(rd.read_data_u8().map_err(debug)?), 0),
        Marker::Str16 | Marker::Bin16 => (usize::from(rd.read_data_u16().map_err(debug)?), 0),
        Marker::Str32 | Marker::Bin32 => (rd.read_data_u32().map_err(debug)? as usize, 0),
        Marker::FixArray(n) => (0, u64::from(n)),
        Marker::Array16 => (0, u64::from(rd.read_data_u16().map_err(debug)?)),
        Marker::Array32 => (0, u64::from(rd.read_data_u32().map_err(debug)?)),
        Marker::FixMap(n) => (0, 2 * u64::from(n)),
        Marker::Map16 => (0, 2 * u64::from(rd.read_data_u16().map_err(debug)?)),
        Marker::Map32 => (0, 2 * u64::from(rd.read_data_u32().map_err(debug)?)),
        Marker::FixExt1 => (2, 0),
        Marker::FixExt2 => (3, 0),
        Marker::FixExt4 => (5, 0),
        Marker::FixExt8 => (9, 0),
        Marker::FixExt16 => (17, 0),
        Marker::Ext8 => (1 + usize::from(rd.read_data_u8().map_err(debug)?), 0),
        Marker::Ext16 => (1 + usize::from(rd.read_data_u16().map_err(debug)?), 0),
        Marker::Ext32 => (1 + rd.read_data_u32().map_err(debug)? as usize, 0),
        Marker::Reserved => return Err("reserved marker 0xc1".into()),
    };
    take(rd, bytes)?;
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// msgpack by hand for the tests (the Python tests use vLLM's own encoder's bytes).
    fn map_stored() -> Vec<u8> {
        let mut b = vec![0x93, 0xcb];
        b.extend(1.5f64.to_be_bytes());
        b.push(0x91); // one event
        b.push(0x84); // map of 4
        b.extend([0xa4, b't', b'y', b'p', b'e', 0xab]);
        b.extend(b"BlockStored");
        b.extend([0xac]);
        b.extend(b"block_hashes");
        b.extend([0x91, 0xcf]);
        b.extend(u64::MAX.to_be_bytes());
        b.extend([0xa9]);
        b.extend(b"token_ids");
        b.extend([0x92, 0x01, 0xcd, 0x01, 0x00]);
        b.extend([0xaa]);
        b.extend(b"block_size");
        b.push(0x02);
        b.push(0x01); // rank 1
        b
    }

    #[test]
    fn map_encoding() {
        let batch = decode_batch(&map_stored()).unwrap();
        assert_eq!((batch.ts, batch.rank), (1.5, 1));
        let KvEvent::Stored(s) = &batch.events[0] else { panic!() };
        assert_eq!(
            (s.hashes.clone(), s.parent, s.token_ids.clone(), s.block_size),
            (vec![u64::MAX], None, vec![1, 256], 2)
        );
        assert_eq!(s.ignored, None);
    }

    #[test]
    fn array_encoding_and_bytes_hashes() {
        // [0.0, [["BlockRemoved", [bin 2 bytes], "CPU"], ["AllBlocksCleared"]]]
        let mut b = vec![0x92, 0xcb];
        b.extend(0f64.to_be_bytes());
        b.extend([0x92, 0x93, 0xac]);
        b.extend(b"BlockRemoved");
        b.extend([0x91, 0xc4, 0x02, 0xab, 0xcd, 0xa3]);
        b.extend(b"CPU");
        b.extend([0x91, 0xb0]);
        b.extend(b"AllBlocksCleared");
        let batch = decode_batch(&b).unwrap();
        assert_eq!(batch.rank, 0);
        assert_eq!(
            batch.events,
            vec![
                KvEvent::Removed {
                    hashes: vec![xxh3_64(&[0xab, 0xcd])],
                    ignored: Some("blocks on a medium other than the GPU")
                },
                KvEvent::Cleared
            ]
        );
    }

    #[test]
    fn errors_name_the_event_and_field() {
        let mut b = map_stored();
        let at = b.len() - 2; // block_size 2 -> "x"
        b[at] = 0xa1;
        b.insert(at + 1, b'x');
        let err = decode_batch(&b).unwrap_err().0;
        assert!(err.starts_with("event 0: field block_size: expected an integer"), "{err}");
        let short = &map_stored()[..20];
        assert!(decode_batch(short).is_err());
        assert!(decode_batch(&[0x90]).unwrap_err().0.contains("array of 0"));
        let mut tokens = map_stored();
        let pos = tokens.windows(2).position(|w| w == [0x92, 0x01]).unwrap();
        tokens[pos] = 0x91; // one token id for one block of 2, and a stray byte after
        assert!(decode_batch(&tokens).is_err());
    }
}
