//! A prefix cache of tokenizations: a prompt that extends one tokenized before (the next turn
//! of an agent's session, the same system prompt) is tokenized from near the end of what they
//! share, and the ids before are the earlier prompt's.
//!
//! Splicing is exact only where the tokenizer's work does not cross the cut. The cut is taken
//! where that holds for the byte-level BPE tokenizers of current models, and the result is
//! checked besides:
//! - at the start of a line (after `\n`, before a character that is not whitespace) or of a
//!   word (a space between two characters that are not whitespace), at least [`MARGIN`] bytes
//!   before where the prompts part (their pre-tokenizers split there, and merges never cross a
//!   split), where the earlier prompt's tokens also end;
//! - the part after the cut is tokenized alone, and a window from [`BACK`] tokens before the
//!   cut to [`WINDOW`] bytes after it is tokenized again: the splice is taken only if the
//!   window's ids are the earlier prompt's ids before the cut followed by the new part's.
//!
//! A prompt kept whole (a retry, a repeated request) is its ids at once. Anything else (no
//! shared part of [`MIN_SHARED`] bytes, no such cut, a window that disagrees, a post-processor
//! that adds tokens at the end) tokenizes the whole prompt.
//!
//! Memory: the [`MAX_ENTRIES`] most recent prompts (their text and 12 bytes a token) up to
//! [`MAX_BYTES`]; a prompt that a newer one extends is dropped. Cost of a hit: one scan of
//! the entries' first bytes, a comparison of the shared part, and tokenizing the new part
//! and the window. Thread-safe: one mutex, not held while tokenizing.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokenizers::Tokenizer;

use super::TextError;

/// Bytes the prompts must share for the cache to be used.
pub const MIN_SHARED: usize = 1024;
/// Bytes kept between the cut and where the prompts part.
pub const MARGIN: usize = 256;
/// Tokens before the cut that the check's window starts with.
pub const BACK: usize = 8;
/// Bytes after the cut that the check's window covers.
pub const WINDOW: usize = 256;
/// Prompts kept, and their total size.
pub const MAX_ENTRIES: usize = 256;
pub const MAX_BYTES: usize = 64 << 20;
/// Bytes of the start of a prompt compared before the rest.
const HEAD: usize = 64;

struct Entry {
    text: Box<str>,
    special: bool,
    ids: Vec<u32>,
    /// Each token's byte offsets in `text`.
    offsets: Vec<(u32, u32)>,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.text.len() + self.ids.len() * 12
    }
}

/// The cache (see the module doc).
pub struct PrefixCache {
    entries: Mutex<(VecDeque<Arc<Entry>>, usize)>,
    /// Special tokens the post-processor puts in front (None: it adds some elsewhere too, so
    /// prompts with special tokens are not spliced).
    leading: Option<usize>,
    /// Prompts of at least [`MIN_SHARED`] bytes spliced, and tokenized whole.
    spliced: AtomicU64,
    whole: AtomicU64,
}

/// Token ids and each one's byte offsets.
type Tokens = (Vec<u32>, Vec<(u32, u32)>);

fn encode(tok: &Tokenizer, text: &str, special: bool) -> Result<Tokens, TextError> {
    let e = tok.encode(text, special).map_err(|e| TextError(format!("the tokenizer failed: {e}")))?;
    let offsets = e.get_offsets().iter().map(|&(a, b)| (a as u32, b as u32)).collect();
    Ok((e.get_ids().to_vec(), offsets))
}

/// The ids of `text` from the tokenizer alone.
pub fn encode_ids(tok: &Tokenizer, text: &str, special: bool) -> Result<Vec<u32>, TextError> {
    tok.encode_fast(text, special)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| TextError(format!("the tokenizer failed: {e}")))
}

/// Whether `b` is where a line with content starts (after `\n`) or a word does (at a space
/// after a byte that is not ASCII whitespace), before a byte that is not ASCII whitespace.
fn cut_point(text: &[u8], b: usize) -> bool {
    let next_is_content = |i: usize| text.get(i).is_some_and(|c| !c.is_ascii_whitespace());
    b > 0
        && match text[b - 1] {
            b'\n' => next_is_content(b),
            prev => text[b] == b' ' && !prev.is_ascii_whitespace() && next_is_content(b + 1),
        }
}

impl PrefixCache {
    /// A cache for `tok`, which it probes for what its post-processor adds.
    pub fn new(tok: &Tokenizer) -> Self {
        let probe = "kv cache\nprobe";
        let leading = match (tok.encode_fast(probe, true), tok.encode_fast(probe, false)) {
            (Ok(with), Ok(without)) => {
                let (w, wo) = (with.get_ids(), without.get_ids());
                (w.len() >= wo.len() && w.ends_with(wo)).then(|| w.len() - wo.len())
            }
            _ => None,
        };
        Self {
            entries: Mutex::new((VecDeque::new(), 0)),
            leading,
            spliced: AtomicU64::new(0),
            whole: AtomicU64::new(0),
        }
    }

    /// Prompts (of at least [`MIN_SHARED`] bytes) spliced, and tokenized whole, so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.spliced.load(Ordering::Relaxed), self.whole.load(Ordering::Relaxed))
    }

    /// The ids of `text` (with the tokenizer's special tokens when `special`), spliced from
    /// an earlier prompt's where it can be (see the module doc).
    pub fn encode(&self, tok: &Tokenizer, text: &str, special: bool) -> Result<Vec<u32>, TextError> {
        if text.len() < MIN_SHARED {
            return encode_ids(tok, text, special);
        }
        let spliced = match self.best(text, special) {
            // A prompt tokenized before (a retry, a repeated request): its ids at once.
            Some(earlier) if *earlier.text == *text => Some((earlier.ids.clone(), earlier.offsets.clone())),
            Some(earlier) => self.splice(tok, &earlier, text, special)?,
            None => None,
        };
        let counter = if spliced.is_some() { &self.spliced } else { &self.whole };
        counter.fetch_add(1, Ordering::Relaxed);
        let (ids, offsets) = match spliced {
            Some(done) => done,
            None => encode(tok, text, special)?,
        };
        self.insert(Entry { text: text.into(), special, ids: ids.clone(), offsets });
        Ok(ids)
    }

    /// The kept prompt that shares the longest start with `text`, if any shares enough.
    fn best(&self, text: &str, special: bool) -> Option<Arc<Entry>> {
        let head = &text.as_bytes()[..HEAD.min(text.len())];
        let guard = self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut best: Option<(usize, &Arc<Entry>)> = None;
        for e in guard.0.iter().rev() {
            if e.special != special || !e.text.as_bytes().starts_with(head) {
                continue;
            }
            let shared = common_prefix(e.text.as_bytes(), text.as_bytes());
            if shared >= MIN_SHARED && best.is_none_or(|(b, _)| shared > b) {
                best = Some((shared, e));
            }
        }
        best.map(|(_, e)| Arc::clone(e))
    }

    /// `text`'s ids and offsets from `earlier`'s, or None where the splice is not sure.
    fn splice(
        &self,
        tok: &Tokenizer,
        earlier: &Entry,
        text: &str,
        special: bool,
    ) -> Result<Option<Tokens>, TextError> {
        if special && self.leading.is_none() {
            return Ok(None);
        }
        let bytes = text.as_bytes();
        let shared = common_prefix(earlier.text.as_bytes(), bytes);
        let Some(limit) = shared.checked_sub(MARGIN) else { return Ok(None) };
        // The last line or word start before the limit where an earlier token ends.
        let mut cut_token = None;
        for cut in (1..=limit).rev().filter(|&b| cut_point(bytes, b)).take(8) {
            let j = earlier.offsets.partition_point(|&(_, end)| (end as usize) <= cut);
            let next_start = earlier.offsets.get(j).map_or(usize::MAX, |&(start, _)| start as usize);
            if j > 0 && earlier.offsets[j - 1].1 as usize == cut && next_start >= cut {
                cut_token = Some((cut, j));
                break;
            }
        }
        let Some((cut, kept)) = cut_token else { return Ok(None) };
        let lead = if special { self.leading.unwrap_or(0) } else { 0 };
        if kept < lead + BACK + 1 {
            return Ok(None);
        }
        let (tail_ids, tail_offsets) = encode(tok, &text[cut..], false)?;
        // The check: the window from BACK tokens before the cut, tokenized at once.
        let from = earlier.offsets[kept - BACK - 1].1 as usize;
        if !text.is_char_boundary(from) {
            return Ok(None);
        }
        let mut to = (cut + WINDOW).min(text.len());
        while !text.is_char_boundary(to) {
            to += 1;
        }
        let (window, window_offsets) = encode(tok, &text[from..to], false)?;
        let expected = earlier.ids[kept - BACK..kept].iter().chain(tail_ids.iter()).copied();
        // Tokens near the window's end may be cut short by it: compare the rest.
        let sure = window_offsets.iter().take_while(|&&(_, end)| (end as usize) + from + 32 <= to).count();
        if sure < BACK + 1 || !window.iter().take(sure).copied().eq(expected.take(sure)) {
            return Ok(None);
        }
        let mut ids = earlier.ids[..kept].to_vec();
        ids.extend_from_slice(&tail_ids);
        let mut offsets = earlier.offsets[..kept].to_vec();
        let shift = cut as u32;
        offsets.extend(tail_offsets.iter().map(|&(a, b)| (a + shift, b + shift)));
        Ok(Some((ids, offsets)))
    }

    fn insert(&self, entry: Entry) {
        let mut guard = self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (entries, bytes) = &mut *guard;
        // A prompt the new one extends is not needed any more.
        entries.retain(|e| {
            let extended = e.special == entry.special && entry.text.starts_with(&*e.text);
            if extended {
                *bytes -= e.bytes();
            }
            !extended
        });
        *bytes += entry.bytes();
        entries.push_back(Arc::new(entry));
        while entries.len() > MAX_ENTRIES || (*bytes > MAX_BYTES && entries.len() > 1) {
            if let Some(old) = entries.pop_front() {
                *bytes -= old.bytes();
            }
        }
    }
}

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let chunks = a[..n].chunks_exact(32).zip(b[..n].chunks_exact(32));
    let whole = chunks.take_while(|(x, y)| x == y).count() * 32;
    whole + a[whole..n].iter().zip(&b[whole..n]).take_while(|(x, y)| x == y).count()
}
