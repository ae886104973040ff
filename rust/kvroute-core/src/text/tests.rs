//! The text model on a small folder of its own: a word-level tokenizer and templates whose
//! renders are those of Jinja2 under transformers' settings (checked against
//! transformers by the Python suite, `tests/test_text_model.py`).

use std::ops::Deref;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::{pyjson, TextModel};

/// A folder under the system's temporary one, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("kvroute-text-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A model folder with a word-level tokenizer (`[UNK]` 0, `<s>` 1, then `words`) that adds
/// `<s>` in front of a single sequence, and `config` as `tokenizer_config.json`.
fn folder(name: &str, config: &Value, jinja: Option<&str>) -> Scratch {
    let dir = Scratch::new(name);
    let words = ["hello", "world", "<|im_start|>", "<|im_end|>", "user", "assistant", "hi"];
    let mut vocab = Map::new();
    vocab.insert("[UNK]".into(), json!(0));
    vocab.insert("<s>".into(), json!(1));
    for (i, w) in words.iter().enumerate() {
        vocab.insert((*w).into(), json!(i + 2));
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
             "normalized": false, "special": true},
            {"id": 4, "content": "<|im_start|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true},
            {"id": 5, "content": "<|im_end|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    if let Some(text) = jinja {
        std::fs::write(dir.join("chat_template.jinja"), text).unwrap();
    }
    dir
}

const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n\
    {{ message['content'] }}<|im_end|>\n{% endfor %}\
    {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn body(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

#[test]
fn completions_and_chat_are_tokenized_as_vllm_does() {
    let dir = folder("chatml", &json!({"chat_template": CHATML, "eos_token": "<|im_end|>"}), None);
    let model = TextModel::load(&dir).unwrap();
    // A completions prompt gets the tokenizer's special tokens (here <s>), a chat does not.
    let text = model.prompt_ids(&body(json!({"prompt": "hello world"})), false).unwrap();
    assert_eq!(text, Some(vec![1, 2, 3]));
    let raw = body(json!({"prompt": "hello", "add_special_tokens": false}));
    assert_eq!(model.prompt_ids(&raw, false).unwrap(), Some(vec![2]));
    assert_eq!(model.prompt_ids(&body(json!({"prompt": [1, 2]})), false).unwrap(), None);
    let chat = body(json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(model.render_chat(&chat).unwrap(), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(model.prompt_ids(&chat, true).unwrap(), Some(vec![4, 6, 8, 5, 4, 7]));
    // Text parts are joined by newlines; add_generation_prompt is the request's.
    let parts = body(json!({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                   {"type": "text", "text": "world"}]}],
        "add_generation_prompt": false
    }));
    assert_eq!(model.render_chat(&parts).unwrap(), "<|im_start|>user\nhello\nworld<|im_end|>\n");
    let image = body(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}));
    assert!(model.render_chat(&image).is_err());
    assert!(model.render_chat(&body(json!({"messages": []}))).is_err());
    let cont = body(json!({"messages": [{"role": "user", "content": "hi"}],
                           "continue_final_message": true}));
    assert!(model.render_chat(&cont).is_err());
}

#[test]
fn templates_render_as_jinja2_does_under_transformers() {
    // trim_blocks and lstrip_blocks, Python string methods, loop controls, namespace,
    // special tokens, chat_template_kwargs, tools through tojson, raise_exception.
    let template = "{{ bos_token }}{% set ns = namespace(n=0) %}\n\
        {% for m in messages %}\n  {% if m.role == 'system' %}{% continue %}{% endif %}\n\
        {% set ns.n = ns.n + 1 %}[{{ m.role.upper() }}] {{ m.content.strip() }}\n\
        {% endfor %}\n{% if tools %}{{ tools | tojson }}{% endif %}\
        {% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}\
        {{ ns.n }}";
    let config = json!({"bos_token": {"content": "<s>"}, "chat_template": [
        {"name": "default", "template": template},
        {"name": "tool_use", "template": format!("T:{template}")}]});
    let model = TextModel::load(&folder("jinja", &config, None)).unwrap();
    let chat = body(json!({
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "  a  "},
                     {"role": "assistant", "content": "b"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": "é"}}}],
        "chat_template_kwargs": {"enable_thinking": false}
    }));
    // With tools, the template named tool_use (transformers' choice).
    let expected = "T:<s>[USER] a\n[ASSISTANT] b\n[{\"type\": \"function\", \"function\": \
        {\"name\": \"f\", \"parameters\": {\"b\": 1, \"a\": \"é\"}}}]<no_think>2";
    assert_eq!(model.render_chat(&chat).unwrap(), expected);
    let mut no_tools = chat.clone();
    no_tools.remove("tools");
    assert_eq!(model.render_chat(&no_tools).unwrap(), "<s>[USER] a\n[ASSISTANT] b\n<no_think>2");
    // chat_template.jinja wins over tokenizer_config.json.
    let raising = "{{ raise_exception('no system messages') }}";
    let model = TextModel::load(&folder("jinja-file", &config, Some(raising))).unwrap();
    let err = model.render_chat(&chat).unwrap_err();
    assert!(err.0.contains("no system messages"), "{err}");
    // No template: tokenizes completions, refuses chats.
    let model = TextModel::load(&folder("none", &json!({}), None)).unwrap();
    assert!(model.template_error().is_some());
    assert!(model.render_chat(&chat).is_err());
    assert!(model.prompt_ids(&body(json!({"prompt": "hi"})), false).unwrap().is_some());
}

#[test]
fn a_folder_without_a_tokenizer_is_an_error() {
    let dir = Scratch::new("empty");
    let err = TextModel::load(&dir).unwrap_err();
    assert!(err.0.contains("tokenizer.json") && err.0.contains("cannot load"), "{err}");
}

#[test]
fn json_dumps_and_strftime_as_python() {
    let v = json!({"b": [1, 2.5, null, true], "a": "x\"\u{1}é\n", "c": {}});
    let plain = pyjson::Options::default();
    assert_eq!(pyjson::dumps(&v, &plain), r#"{"b": [1, 2.5, null, true], "a": "x\"\u0001é\n", "c": {}}"#);
    let sorted = pyjson::Options { sort_keys: true, ensure_ascii: true, ..Default::default() };
    assert_eq!(
        pyjson::dumps(&v, &sorted),
        r#"{"a": "x\"\u0001\u00e9\n", "b": [1, 2.5, null, true], "c": {}}"#
    );
    let indented = pyjson::Options { indent: Some(2), ..Default::default() };
    assert_eq!(pyjson::dumps(&json!({"a": [1]}), &indented), "{\n  \"a\": [\n    1\n  ]\n}");
    let tight = pyjson::Options { separators: Some((",".into(), ":".into())), ..Default::default() };
    assert_eq!(pyjson::dumps(&json!({"a": [1, 2]}), &tight), r#"{"a":[1,2]}"#);
    // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
    let t = 1_709_211_909;
    assert_eq!(
        pyjson::strftime(t, "%d %b %Y %H:%M:%S %A %j %p %y %% %Q"),
        "29 Feb 2024 13:05:09 Thursday 060 PM 24 % %Q"
    );
    assert_eq!(pyjson::strftime(0, "%Y-%m-%d %a %I"), "1970-01-01 Thu 12");
}
