//! What an answer generated, read in Rust: the first choice's token ids (when the answer
//! carries them), its text, and the usage's `completion_tokens`, from a whole answer or an
//! SSE stream, so that the blocks the engine stores for the output can be recorded without
//! the hooks (and the interpreter) on the relay's event loop.
//!
//! It answers only where its answer is the Python hook's for certain (`answer_output` of
//! `kvroute.proxy.keys`, which the parity tests hold it to): each event a strict JSON object,
//! `choices` a list of objects, a choice's `index` absent or an integer, `token_ids` a list of
//! 32-bit ids, `completion_tokens` a non-negative integer. Anything else gives `None`, and the
//! hook reads the answer in its own way.
//!
//! O(answer) to parse; stateless and thread-safe.

use serde_json::{Map, Value};

/// What an answer generated (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerOutput {
    /// The first choice's `token_ids`, all of them in order, when any event has the field.
    pub ids: Option<Vec<u32>>,
    /// The first choice's text (`text`, else its message's or delta's `content`).
    pub text: String,
    /// The last usage's `completion_tokens`.
    pub generated: Option<u64>,
}

/// The output of `raw` (an SSE body when `stream`), or `None` where the hook must read it.
pub fn answer_output(raw: &[u8], stream: bool) -> Option<AnswerOutput> {
    let mut out = AnswerOutput { ids: None, text: String::new(), generated: None };
    if !stream {
        read_event(&mut out, raw)?;
        return Some(out);
    }
    for line in raw.split(|&b| b == b'\n') {
        let Some(data) = line.strip_prefix(b"data:") else { continue };
        if data.trim_ascii() == b"[DONE]" {
            continue;
        }
        read_event(&mut out, data)?;
    }
    Some(out)
}

fn read_event(out: &mut AnswerOutput, data: &[u8]) -> Option<()> {
    let Value::Object(event) = serde_json::from_slice::<Value>(data).ok()? else { return None };
    match event.get("choices") {
        Some(Value::Array(choices)) => {
            for choice in choices {
                read_choice(out, choice.as_object()?)?;
            }
        }
        Some(other) if truthy(other) => return None,
        _ => {}
    }
    if let Some(Value::Object(usage)) = event.get("usage") {
        match usage.get("completion_tokens") {
            Some(Value::Number(n)) => out.generated = Some(n.as_u64()?),
            Some(Value::Bool(_)) => return None,
            _ => {}
        }
    }
    Some(())
}

fn read_choice(out: &mut AnswerOutput, choice: &Map<String, Value>) -> Option<()> {
    match choice.get("index") {
        None => {}
        Some(Value::Number(n)) if n.as_i64() == Some(0) => {}
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => return Some(()), // another choice
        Some(_) => return None,
    }
    if let Some(Value::Array(ids)) = choice.get("token_ids") {
        let got = out.ids.get_or_insert_with(Vec::new);
        for id in ids {
            got.push(id.as_u64().and_then(|i| u32::try_from(i).ok())?);
        }
    }
    let message = [choice.get("delta"), choice.get("message")].into_iter().flatten().find(|v| truthy(v));
    let message = match message {
        None => None,
        Some(Value::Object(m)) => Some(m),
        Some(_) => return None,
    };
    let text = match choice.get("text") {
        Some(t) => Some(t),
        None => message.and_then(|m| m.get("content")),
    };
    if let Some(Value::String(t)) = text {
        out.text.push_str(t);
    }
    Some(())
}

/// Python's truth value of a JSON value.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::{answer_output, AnswerOutput};

    fn out(ids: Option<Vec<u32>>, text: &str, generated: Option<u64>) -> Option<AnswerOutput> {
        Some(AnswerOutput { ids, text: text.into(), generated })
    }

    #[test]
    fn reads_streams_and_whole_answers() {
        let stream = b"data: {\"choices\":[{\"index\":0,\"text\":\"Hel\"}]}\r\n\r\n\
            data: {\"choices\":[{\"index\":1,\"text\":\"x\"},{\"text\":\"lo\",\"token_ids\":[5,6]}]}\n\n\
            data: {\"choices\":[],\"usage\":{\"completion_tokens\":3}}\n\ndata: [DONE]\n\n";
        assert_eq!(answer_output(stream, true), out(Some(vec![5, 6]), "Hello", Some(3)));
        let chat = br#"{"choices":[{"message":{"role":"assistant","content":"hi"}}],"usage":{"completion_tokens":1}}"#;
        assert_eq!(answer_output(chat, false), out(None, "hi", Some(1)));
        let delta = b"data: {\"choices\":[{\"delta\":{},\"message\":{\"content\":\"m\"}}]}\n";
        assert_eq!(answer_output(delta, true), out(None, "m", None));
        // "text" wins over the message's content, even when it is null.
        let null_text = br#"{"choices":[{"text":null,"message":{"content":"m"}}]}"#;
        assert_eq!(answer_output(null_text, false), out(None, "", None));
    }

    #[test]
    fn leaves_what_it_is_not_sure_of_to_the_hook() {
        for (raw, stream) in [
            (&b"data: {\"choices\":[{\"text\":NaN}]}\n"[..], true),
            (b"data:\n", true),
            (b"[1]", false),
            (br#"{"choices":"abc"}"#, false),
            (br#"{"choices":[1]}"#, false),
            (br#"{"choices":[{"index":0.0}]}"#, false),
            (br#"{"choices":[{"token_ids":[1,-2]}]}"#, false),
            (br#"{"choices":[{"delta":"x"}]}"#, false),
            (br#"{"usage":{"completion_tokens":true}}"#, false),
            (br#"{"usage":{"completion_tokens":-1}}"#, false),
            (br#"{"usage":{"completion_tokens":1e30}}"#, false),
        ] {
            assert_eq!(answer_output(raw, stream), None, "{}", String::from_utf8_lossy(raw));
        }
    }
}
