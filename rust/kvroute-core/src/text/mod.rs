//! A model's own tokenization of text and chat prompts, as vLLM does it, in Rust: the Hugging
//! Face tokenizer of the model's folder (`tokenizer.json`, the `tokenizers` crate) and its chat
//! template (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`), rendered
//! with minijinja as transformers' `apply_chat_template` renders it with Jinja2.
//!
//! - [`TextModel::load`] reads the folder once; [`TextModel::prompt_ids`] gives the token ids
//!   vLLM computes for a completions prompt (the text with the tokenizer's special tokens) or
//!   for a chat (the rendered template, without them).
//! - `template.rs`: the chat template and its environment (`tojson`, `raise_exception`,
//!   `strftime_now`, Python's string methods).
//! - `pyjson.rs`: `json.dumps` as Python writes it (the template's `tojson`).
//! - `cache.rs`: a prefix cache of tokenizations, so that a prompt extending an earlier one
//!   is tokenized from near the end of what they share.
//!
//! Cost: a prompt is one tokenizer call, linear in its length (in what is new, for a prompt
//! that extends a recent one); a chat one template render too. A [`TextModel`] is shared by
//! threads (its cache behind a mutex).

mod cache;
mod pyjson;
mod template;

use std::path::{Path, PathBuf};

use serde_json::Value;

pub use template::ChatTemplate;

/// Why a model's folder cannot be used, or a prompt cannot be tokenized as the engine would.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextError(pub String);

impl std::fmt::Display for TextError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TextError {}

/// A model's tokenizer and chat template (see the module doc).
pub struct TextModel {
    tokenizer: tokenizers::Tokenizer,
    template: Result<ChatTemplate, TextError>,
    cache: cache::PrefixCache,
    dir: PathBuf,
}

impl std::fmt::Debug for TextModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextModel").field("dir", &self.dir).finish_non_exhaustive()
    }
}

impl TextModel {
    /// The tokenizer and chat template of the model folder `dir`. A folder without a usable
    /// `tokenizer.json` is an error; one without a usable chat template loads, and its chats
    /// are refused by [`TextModel::prompt_ids`] (see [`TextModel::template_error`]).
    pub fn load(dir: &Path) -> Result<Self, TextError> {
        let path = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| TextError(format!("{}: cannot load the tokenizer: {e}", path.display())))?;
        let template = ChatTemplate::load(dir);
        let cache = cache::PrefixCache::new(&tokenizer);
        Ok(Self { tokenizer, template, cache, dir: dir.to_path_buf() })
    }

    /// The model's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Long prompts tokenized by splicing an earlier one's ids, and tokenized whole.
    pub fn cache_counts(&self) -> (u64, u64) {
        self.cache.counts()
    }

    /// Why chats cannot be rendered, when they cannot.
    pub fn template_error(&self) -> Option<&TextError> {
        self.template.as_ref().err()
    }

    /// The token ids of `text`, with the tokenizer's special tokens when `special` (from
    /// the prefix cache's splice where a recent prompt shares its start).
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, TextError> {
        self.cache.encode(&self.tokenizer, text, special)
    }

    /// The token ids of an answer's `text` (no special tokens), past the prefix cache (an
    /// answer is not the start of a later prompt: the prompt that extends it is).
    pub fn encode_answer(&self, text: &str) -> Result<Vec<u32>, TextError> {
        cache::encode_ids(&self.tokenizer, text, false)
    }

    /// A chat body's prompt text: its `messages` (and `tools`, `add_generation_prompt`,
    /// `continue_final_message`, `chat_template_kwargs`) through the chat template.
    pub fn render_chat(&self, body: &serde_json::Map<String, Value>) -> Result<String, TextError> {
        match &self.template {
            Ok(t) => t.render(body),
            Err(e) => Err(e.clone()),
        }
    }

    /// The token ids vLLM computes for a completions body's string `prompt`, or a chat
    /// body's messages (rendered, then tokenized without special tokens: the template has
    /// them). `Ok(None)`: a completions prompt that is not one string (token ids, a batch).
    pub fn prompt_ids(
        &self,
        body: &serde_json::Map<String, Value>,
        chat: bool,
    ) -> Result<Option<Vec<u32>>, TextError> {
        if chat {
            let text = self.render_chat(body)?;
            return self.encode(&text, false).map(Some);
        }
        match body.get("prompt") {
            Some(Value::String(text)) => {
                let special = body.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(true);
                self.encode(text, special).map(Some)
            }
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests;
