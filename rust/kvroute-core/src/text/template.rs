//! A model's chat template rendered as transformers' `apply_chat_template` renders it for vLLM:
//! Jinja2 with `trim_blocks` and `lstrip_blocks`, loop controls, Python's string methods,
//! transformers' `tojson` (Python's `json.dumps`), `raise_exception` and `strftime_now`; the
//! context holds `messages`, `tools`, `add_generation_prompt`, the special tokens of
//! `tokenizer_config.json` (`bos_token`, `eos_token`, `pad_token`, `unk_token`) and the
//! request's `chat_template_kwargs`.
//!
//! Messages are taken as vLLM takes them into the template: a content that is a list of text
//! parts becomes their texts joined by newlines; a part of another kind (an image, audio) is
//! refused, as is `continue_final_message` (vLLM edits the rendered text then).
//!
//! Cost: one render, linear in the template's output. Immutable after loading; shared by
//! threads.

use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, Serde};
use minijinja::{Environment, Error, ErrorKind, Value as JValue};
use serde_json::{Map, Value};

use super::{pyjson, TextError};

/// The templates' names in their environment: the default one, and the one transformers
/// takes for a request with tools when the model names one so.
const DEFAULT: &str = "default";
const TOOL_USE: &str = "tool_use";

/// A chat template and the environment it renders in (see the module doc).
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, `pad_token`, `unk_token` as strings, when set.
    special: Vec<(&'static str, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("special", &self.special).finish_non_exhaustive()
    }
}

fn read_json(path: &Path) -> Result<Option<Map<String, Value>>, TextError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TextError(format!("{}: cannot read: {e}", path.display()))),
    };
    match serde_json::from_str(&text) {
        Ok(Value::Object(map)) => Ok(Some(map)),
        Ok(_) => Err(TextError(format!("{}: not a JSON object", path.display()))),
        Err(e) => Err(TextError(format!("{}: not JSON: {e}", path.display()))),
    }
}

/// A special token's text: a string, or an added token's `content`.
fn token_text(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// The templates of `chat_template` (a string, or a list of named templates) by name: the
/// default one, and `tool_use` when there is one.
fn named_templates(value: &Value, path: &Path) -> Result<Vec<(&'static str, String)>, TextError> {
    match value {
        Value::String(s) => Ok(vec![(DEFAULT, s.clone())]),
        Value::Array(named) => {
            let find = |name: &str| {
                named
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
                    .and_then(|t| t.get("template")?.as_str())
                    .map(str::to_owned)
            };
            let default = find(DEFAULT)
                .ok_or_else(|| TextError(format!("{}: chat_template has no \"default\"", path.display())))?;
            let mut out = vec![(DEFAULT, default)];
            out.extend(find(TOOL_USE).map(|t| (TOOL_USE, t)));
            Ok(out)
        }
        _ => Err(TextError(format!("{}: chat_template is not a string", path.display()))),
    }
}

impl ChatTemplate {
    /// The template of the model folder `dir`: `chat_template.jinja`, else the
    /// `chat_template` of `tokenizer_config.json` (which also names the special tokens).
    pub fn load(dir: &Path) -> Result<Self, TextError> {
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?.unwrap_or_default();
        let jinja = dir.join("chat_template.jinja");
        let sources = match std::fs::read_to_string(&jinja) {
            Ok(s) => vec![(DEFAULT, s)],
            Err(_) => match config.get("chat_template") {
                Some(v) => named_templates(v, &config_path)?,
                None => {
                    return Err(TextError(format!(
                        "{}: the model has no chat template (no chat_template.jinja, no \
                         chat_template in tokenizer_config.json)",
                        dir.display()
                    )))
                }
            },
        };
        let special = ["bos_token", "eos_token", "pad_token", "unk_token"]
            .into_iter()
            .filter_map(|k| token_text(config.get(k)).map(|t| (k, t)))
            .collect();
        Ok(Self { env: environment(sources)?, special })
    }

    /// The text of a chat body's messages through the template (see the module doc).
    pub fn render(&self, body: &Map<String, Value>) -> Result<String, TextError> {
        let mut ctx = Map::new();
        for (k, v) in &self.special {
            ctx.insert((*k).to_owned(), Value::String(v.clone()));
        }
        if let Some(Value::Object(kwargs)) = body.get("chat_template_kwargs") {
            for (k, v) in kwargs {
                ctx.insert(k.clone(), v.clone());
            }
        }
        if body.get("continue_final_message").and_then(Value::as_bool) == Some(true) {
            return Err(TextError("continue_final_message is not rendered here".into()));
        }
        let messages = match body.get("messages") {
            Some(Value::Array(m)) if !m.is_empty() => m,
            _ => return Err(TextError("'messages' must be a non-empty list".into())),
        };
        let messages: Result<Vec<Value>, TextError> = messages.iter().map(message).collect();
        ctx.insert("messages".into(), Value::Array(messages?));
        let generation = body.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true);
        ctx.insert("add_generation_prompt".into(), Value::Bool(generation));
        let mut name = DEFAULT;
        match body.get("tools") {
            Some(tools @ Value::Array(_)) => {
                ctx.insert("tools".into(), tools.clone());
                if self.env.get_template(TOOL_USE).is_ok() {
                    name = TOOL_USE;
                }
            }
            _ => {
                ctx.insert("tools".into(), Value::Null);
            }
        }
        let template = self.env.get_template(name).map_err(render_error)?;
        template.render(JValue::from(Serde(&ctx))).map_err(render_error)
    }
}

/// One message as vLLM hands it to the template (see the module doc).
fn message(m: &Value) -> Result<Value, TextError> {
    let Value::Object(fields) = m else {
        return Err(TextError("a message must be an object".into()));
    };
    let mut out = fields.clone();
    if let Some(Value::Array(parts)) = fields.get("content") {
        let mut texts = Vec::with_capacity(parts.len());
        for part in parts {
            match (part.get("type").and_then(Value::as_str), part.get("text")) {
                (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
                _ => return Err(TextError("a content part that is not text".into())),
            }
        }
        out.insert("content".into(), Value::String(texts.join("\n")));
    }
    Ok(Value::Object(out))
}

fn render_error(e: Error) -> TextError {
    TextError(format!("the chat template failed: {e:#}"))
}

fn environment(sources: Vec<(&'static str, String)>) -> Result<Environment<'static>, TextError> {
    let mut env = Environment::new();
    let syntax = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build();
    env.set_syntax(syntax.map_err(|e| TextError(format!("the template syntax: {e}")))?);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    for (name, source) in sources {
        env.add_template_owned(name, source)
            .map_err(|e| TextError(format!("the chat template does not compile: {e:#}")))?;
    }
    Ok(env)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=..., separators=...,
/// sort_keys=...)`.
fn tojson(value: JValue, kwargs: Kwargs) -> Result<JValue, Error> {
    let json: Value = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let separators = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(pair) if pair.len() == 2 => Some((pair[0].clone(), pair[1].clone())),
        Some(_) => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators")),
        None => None,
    };
    let options = pyjson::Options {
        indent: kwargs.get::<Option<usize>>("indent")?,
        separators,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    Ok(JValue::from_safe_string(pyjson::dumps(&json, &options)))
}

fn raise_exception(message: String) -> Result<JValue, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String, _rest: Rest<JValue>) -> Result<JValue, Error> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    Ok(JValue::from(pyjson::strftime(secs, &format)))
}
