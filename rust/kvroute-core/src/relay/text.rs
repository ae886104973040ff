//! Keying a text completions or chat body in Rust with the model's own tokenizer and chat
//! template ([`TextModel`]), without the Python hook: the prompt's token ids as vLLM
//! computes them, and the two top-level fields routing reads, `stream` and the session field.
//!
//! As for token-id bodies (`body.rs`), it answers only when its answer is the Python keyer's
//! for certain (the keyer asks the same [`TextModel`] for the same body's ids): a strict JSON
//! object whose `stream` is absent or a boolean, whose session field is a string of at most
//! [`MAX_SESSION_ID_BYTES`](super::body::MAX_SESSION_ID_BYTES) bytes, an integer within 64
//! bits, or a value of another kind (no session); a completions `prompt` that is one string;
//! chat `messages` that are a non-empty list of objects with a string `role`, which the
//! template renders. Anything else gives `None` and goes to the hook, which refuses, or keys,
//! in its own words.
//!
//! O(body) to parse plus the tokenizer's and the template's time; stateless and
//! thread-safe.

use serde_json::{Map, Value};

use crate::text::TextModel;
use crate::Id;

use super::body::keyed;
use super::Keyed;

/// The routing inputs of a text completions or chat `body` (see the module doc);
/// `session_header`: the session header's value, which wins over the body's field.
pub fn text_prompt(
    model: &TextModel,
    body: &[u8],
    chat: bool,
    block_size: usize,
    session_field: Option<&str>,
    session_header: Option<&str>,
) -> Option<Keyed> {
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    let stream = match map.get("stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return None,
    };
    let session = match session_header.filter(|h| !h.is_empty()) {
        Some(h) => Some(Id::Str(h.to_owned())),
        None => match session_field.and_then(|f| map.get(f)) {
            Some(v) => session_value(v)?,
            None => None,
        },
    };
    if chat && !messages_ok(&map) {
        return None;
    }
    let ids = model.prompt_ids(&map, chat).ok()??;
    if ids.is_empty() {
        return None;
    }
    keyed(&ids, block_size, stream, session)
}

/// A session field's value: `Some(None)` for no session, `None` when the hook must decide.
fn session_value(value: &Value) -> Option<Option<Id>> {
    match value {
        Value::String(s) => Some((!s.is_empty()).then(|| Id::Str(s.clone()))),
        Value::Number(n) => n.as_i64().map(|i| Some(Id::Int(i))),
        _ => Some(None),
    }
}

/// Whether a chat body's `messages` pass the Python keyer's check.
fn messages_ok(map: &Map<String, Value>) -> bool {
    match map.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => {
            m.iter().all(|m| matches!(m.get("role"), Some(Value::String(_))))
        }
        _ => false,
    }
}
