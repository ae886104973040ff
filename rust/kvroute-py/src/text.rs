//! `kvroute._core.TextModel`: a model's tokenizer and chat template
//! (`kvroute_core::text::TextModel`) for the proxy's keyer, which asks it for exactly the ids
//! the relay computes. Every call releases the GIL while it tokenizes or renders; the
//! object is immutable and shared by threads (the relay holds the same one).

use std::path::PathBuf;
use std::sync::Arc;

use kvroute_core::text::{TextError, TextModel};
use pyo3::prelude::*;

use crate::errors::invalid;

/// A model folder's tokenizer and chat template.
#[pyclass(name = "TextModel", module = "kvroute._core", frozen)]
pub struct PyTextModel {
    pub(crate) model: Arc<TextModel>,
}

fn body_map(py: Python<'_>, body: &[u8]) -> PyResult<serde_json::Map<String, serde_json::Value>> {
    match serde_json::from_slice(body) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err(invalid(py, "the body must be a JSON object".into())),
        Err(e) => Err(invalid(py, format!("the body is not JSON: {e}"))),
    }
}

fn text_error(py: Python<'_>, e: TextError) -> PyErr {
    invalid(py, e.0)
}

#[pymethods]
impl PyTextModel {
    #[new]
    fn new(py: Python<'_>, dir: PathBuf) -> PyResult<Self> {
        let model = py.detach(|| TextModel::load(&dir)).map_err(|e| text_error(py, e))?;
        Ok(Self { model: Arc::new(model) })
    }

    /// The model's folder.
    #[getter]
    fn dir(&self) -> PathBuf {
        self.model.dir().to_path_buf()
    }

    /// Long prompts tokenized from an earlier one's ids (the prefix cache), and whole.
    #[getter]
    fn cache_counts(&self) -> (u64, u64) {
        self.model.cache_counts()
    }

    /// Why the model's chats cannot be rendered, or None.
    #[getter]
    fn template_error(&self) -> Option<String> {
        self.model.template_error().map(|e| e.0.clone())
    }

    /// The token ids of `text` (with the tokenizer's special tokens when `special`).
    #[pyo3(signature = (text, special = true))]
    fn encode(&self, py: Python<'_>, text: &str, special: bool) -> PyResult<Vec<u32>> {
        py.detach(|| self.model.encode(text, special)).map_err(|e| text_error(py, e))
    }

    /// A chat body's (JSON bytes) prompt text through the chat template.
    fn render_chat(&self, py: Python<'_>, body: &[u8]) -> PyResult<String> {
        let map = body_map(py, body)?;
        py.detach(|| self.model.render_chat(&map)).map_err(|e| text_error(py, e))
    }

    /// The token ids vLLM computes for a completions body's string prompt or a chat body's
    /// messages (JSON bytes); None for a completions prompt that is not one string.
    fn prompt_ids(&self, py: Python<'_>, body: &[u8], chat: bool) -> PyResult<Option<Vec<u32>>> {
        let map = body_map(py, body)?;
        py.detach(|| self.model.prompt_ids(&map, chat)).map_err(|e| text_error(py, e))
    }
}
