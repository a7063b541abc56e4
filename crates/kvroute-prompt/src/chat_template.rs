//! A model's own chat template, as its `tokenizer_config.json` gives it.
//!
//! vLLM and SGLang turn chat `messages` into prompt text with the Jinja
//! template in the model's `tokenizer_config.json` (`chat_template`), then
//! tokenize that text. A router that wants the engine's block hashes must
//! render the same text, so `kvroute serve --tokenizer` and
//! `kvroute mocker --tokenizer` both load the template that sits beside the
//! `tokenizer.json` and render it with `minijinja` (Jinja2-compatible, with
//! the Python string methods HF templates use).
//!
//! The template sees what `transformers`' `apply_chat_template` passes:
//! `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and the
//! helpers `raise_exception(msg)` and `strftime_now(fmt)`.

use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::{context, Environment, Error, ErrorKind};
use serde_json::Value;

/// File name of the config read beside `tokenizer.json`.
pub const CONFIG_FILE: &str = "tokenizer_config.json";

/// The file newer models keep their template in, beside the configuration
/// (which then has no `chat_template`; its tokens still come from there).
pub const TEMPLATE_FILE: &str = "chat_template.jinja";

/// Why a template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatTemplateError {
    /// The config file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The config is not JSON, or `chat_template` has an unknown shape.
    #[error("invalid tokenizer_config.json: {0}")]
    Config(String),
    /// The template does not compile.
    #[error("chat template does not compile: {0}")]
    Compile(String),
    /// Rendering failed (including the template's own `raise_exception`).
    #[error("chat template failed: {0}")]
    Render(String),
}

/// A compiled chat template with the special tokens it refers to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat";

/// A special token as `tokenizer_config.json` writes it: a string, or an
/// `AddedToken` object with `content`.
fn token_text(value: Option<&Value>) -> String {
    match value {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now` for templates that print today's date; the date is fixed
/// at the Unix epoch so that rendering is deterministic and the router and
/// the engine agree on the text (real engines use the wall clock, which only
/// matters for templates that print the date).
fn strftime_now(format: String) -> String {
    format
        .replace("%Y", "1970")
        .replace("%m", "01")
        .replace("%d", "01")
        .replace("%B", "January")
        .replace("%b", "Jan")
}

impl ChatTemplate {
    /// The template of a `tokenizer_config.json` text; `Ok(None)` when it has
    /// no `chat_template`. A list of named templates uses the one named
    /// `default`.
    pub fn from_config(config_json: &str) -> Result<Option<Self>, ChatTemplateError> {
        let config: Value = serde_json::from_str(config_json)
            .map_err(|e| ChatTemplateError::Config(e.to_string()))?;
        let source = match config.get("chat_template") {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ChatTemplateError::Config(
                        "no template named `default` in `chat_template`".into(),
                    )
                })?
                .to_owned(),
            Some(_) => {
                return Err(ChatTemplateError::Config(
                    "`chat_template` must be a string or a list of named templates".into(),
                ))
            }
        };
        Self::new(
            source,
            token_text(config.get("bos_token")),
            token_text(config.get("eos_token")),
        )
        .map(Some)
    }

    /// The template in `tokenizer_config.json` beside `tokenizer_json`;
    /// `Ok(None)` when there is no such file or it has no template.
    pub fn beside(tokenizer_json: &Path) -> Result<Option<Self>, ChatTemplateError> {
        let read = |name: &str| {
            let path = tokenizer_json.with_file_name(name);
            match std::fs::read_to_string(&path) {
                Ok(text) => Ok(Some(text)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(source) => Err(ChatTemplateError::Read {
                    path: path.display().to_string(),
                    source,
                }),
            }
        };
        let config = read(CONFIG_FILE)?;
        if let Some(template) = config
            .as_deref()
            .map(Self::from_config)
            .transpose()?
            .flatten()
        {
            return Ok(Some(template));
        }
        let Some(source) = read(TEMPLATE_FILE)? else {
            return Ok(None);
        };
        let config: Value = match config {
            Some(text) => {
                serde_json::from_str(&text).map_err(|e| ChatTemplateError::Config(e.to_string()))?
            }
            None => Value::Null,
        };
        Self::new(
            source,
            token_text(config.get("bos_token")),
            token_text(config.get("eos_token")),
        )
        .map(Some)
    }

    /// Compiles `source` with the given special tokens.
    pub fn new(
        source: String,
        bos_token: String,
        eos_token: String,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // transformers renders with trim_blocks and lstrip_blocks on.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatTemplateError::Compile(e.to_string()))?;
        env.set_syntax(syntax);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source)
            .map_err(|e| ChatTemplateError::Compile(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The prompt text of `messages` (an array of `{role, content}`), ending
    /// with the assistant's header when `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| ChatTemplateError::Render(e.to_string()))?;
        template
            .render(context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(|e| ChatTemplateError::Render(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Qwen2's template, as its `tokenizer_config.json` ships it.
    const QWEN2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn qwen2() -> ChatTemplate {
        let config = json!({"chat_template": QWEN2, "eos_token": "<|im_end|>", "bos_token": null});
        ChatTemplate::from_config(&config.to_string())
            .expect("config")
            .expect("has a template")
    }

    #[test]
    fn qwen2_template_renders_chatml_with_its_default_system_prompt() {
        let text = qwen2()
            .render(&json!([{"role": "user", "content": "Hi"}]), true)
            .expect("renders");
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_prompt = qwen2()
            .render(&json!([{"role": "user", "content": "Hi"}]), false)
            .expect("renders");
        assert!(!no_prompt.ends_with("assistant\n"));
    }

    #[test]
    fn special_tokens_python_methods_and_named_templates_work() {
        // Llama-style: bos_token as an AddedToken object, `.strip()`, and a
        // list of named templates.
        let config = json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": [
                {"name": "tool_use", "template": "unused"},
                {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'].strip() }}{{ eos_token }}{% endfor %}"}
            ]
        });
        let t = ChatTemplate::from_config(&config.to_string())
            .expect("config")
            .expect("template");
        let text = t
            .render(&json!([{"role": "user", "content": "  hello  "}]), true)
            .expect("renders");
        assert_eq!(text, "<s>[USER] hello</s>");
    }

    #[test]
    fn raise_exception_becomes_a_render_error() {
        let config = json!({"chat_template": "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"});
        let t = ChatTemplate::from_config(&config.to_string())
            .expect("config")
            .expect("template");
        let err = t
            .render(&json!([{"role": "assistant", "content": "x"}]), true)
            .expect_err("raises");
        assert!(err
            .to_string()
            .contains("first message must be from the user"));
        assert_eq!(
            t.render(&json!([{"role": "user", "content": "x"}]), true)
                .expect("renders"),
            "ok"
        );
    }

    #[test]
    fn configs_without_a_template_or_with_bad_ones_are_told_apart() {
        assert!(ChatTemplate::from_config("{}").expect("valid").is_none());
        assert!(matches!(
            ChatTemplate::from_config("not json"),
            Err(ChatTemplateError::Config(_))
        ));
        assert!(matches!(
            ChatTemplate::from_config(r#"{"chat_template": 3}"#),
            Err(ChatTemplateError::Config(_))
        ));
        assert!(matches!(
            ChatTemplate::from_config(r#"{"chat_template": "{% for %}"}"#),
            Err(ChatTemplateError::Compile(_))
        ));
    }

    #[test]
    fn a_missing_config_file_means_no_template() {
        let dir = std::env::temp_dir().join(format!("kvroute-tpl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let tokenizer = dir.join("tokenizer.json");
        assert!(ChatTemplate::beside(&tokenizer).expect("absent").is_none());
        std::fs::write(
            dir.join(CONFIG_FILE),
            json!({"chat_template": QWEN2}).to_string(),
        )
        .expect("write");
        assert!(ChatTemplate::beside(&tokenizer).expect("present").is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_template_file_beside_a_config_without_one_is_read_with_its_tokens() {
        let dir = std::env::temp_dir().join(format!("kvroute-jinja-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let tokenizer = dir.join("tokenizer.json");
        std::fs::write(
            dir.join(CONFIG_FILE),
            json!({"bos_token": "<s>"}).to_string(),
        )
        .expect("write");
        std::fs::write(
            dir.join(TEMPLATE_FILE),
            "{{ bos_token }}{{ messages[0]['content'] }}",
        )
        .expect("write");
        let t = ChatTemplate::beside(&tokenizer)
            .expect("readable")
            .expect("the template file");
        let text = t
            .render(&json!([{"role": "user", "content": "x"}]), false)
            .expect("renders");
        assert_eq!(text, "<s>x");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
