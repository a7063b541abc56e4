//! The two halves of a migrated answer: the body that asks another rank for
//! the rest ([`continuation`]), and the rewrite of that rank's stream so the
//! client reads one answer ([`Splicer`]): the first answer's id, no second
//! role chunk, and a `usage` that counts the whole answer.

use axum::body::Bytes;
use serde_json::{Map, Value};

use super::transcript::{data_lines, Generated};
use crate::router::Endpoint;

/// What to ask the next rank for.
#[derive(Debug, Clone, PartialEq)]
pub enum Continuation {
    /// Nothing is left to generate: end the client's stream as it is.
    Finished,
    /// This body: the original, continued with what was generated.
    Body(Vec<u8>),
}

/// The body that asks another rank for the rest of `original` after
/// `generated`; `Err` names why it cannot be continued. Nothing generated
/// yet: the original body, asked again whole.
pub fn continuation(
    original: &[u8],
    endpoint: Endpoint,
    generated: &Generated,
) -> Result<Continuation, String> {
    if generated.finished {
        return Ok(Continuation::Finished);
    }
    if generated.pieces == 0 {
        return Ok(Continuation::Body(original.to_vec()));
    }
    let Ok(Value::Object(mut body)) = serde_json::from_slice::<Value>(original) else {
        return Err("the body is not a JSON object".into());
    };
    if body.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Err("several choices (`n` > 1) are not continued".into());
    }
    if body.get("echo") == Some(&Value::Bool(true)) {
        return Err("an `echo` answer is not continued".into());
    }
    if !reduce_budget(&mut body, generated.tokens()) {
        return Ok(Continuation::Finished);
    }
    match endpoint {
        Endpoint::Completions => continue_prompt(&mut body, generated)?,
        Endpoint::Chat => continue_messages(&mut body, generated)?,
        other => {
            return Err(format!(
                "{} answers are not continued mid-way",
                other.path()
            ))
        }
    }
    serde_json::to_vec(&Value::Object(body))
        .map(Continuation::Body)
        .map_err(|e| e.to_string())
}

/// Takes `used` off the output budget (`max_completion_tokens`,
/// `max_tokens`) and `min_tokens`; false when none of the budget is left.
fn reduce_budget(body: &mut Map<String, Value>, used: u64) -> bool {
    for key in ["max_completion_tokens", "max_tokens"] {
        if let Some(max) = body.get(key).and_then(Value::as_u64) {
            let left = max.saturating_sub(used);
            if left == 0 {
                return false;
            }
            body.insert(key.into(), left.into());
        }
    }
    if let Some(min) = body.get("min_tokens").and_then(Value::as_u64) {
        body.insert("min_tokens".into(), min.saturating_sub(used).into());
    }
    true
}

/// A completion's prompt followed by what was generated: token ids after
/// token ids when the engine sent them, text after text otherwise.
fn continue_prompt(body: &mut Map<String, Value>, g: &Generated) -> Result<(), String> {
    let prompt = body.get_mut("prompt");
    match prompt {
        Some(Value::String(text)) => text.push_str(&g.text),
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            if let Some(Value::String(text)) = items.get_mut(0) {
                text.push_str(&g.text);
            }
        }
        Some(Value::Array(ids)) if !ids.is_empty() && ids.iter().all(Value::is_u64) => {
            let Some(generated) = &g.token_ids else {
                return Err("a prompt of token ids is continued only with the engine's token ids (return_token_ids)".into());
            };
            ids.extend(generated.iter().map(|&id| Value::from(id)));
        }
        _ => return Err("only a single prompt (text or token ids) is continued".into()),
    }
    Ok(())
}

/// A chat's messages followed by the partial assistant message, which the
/// engine continues (`continue_final_message`, no generation prompt).
fn continue_messages(body: &mut Map<String, Value>, g: &Generated) -> Result<(), String> {
    let continuing = body.get("continue_final_message") == Some(&Value::Bool(true));
    let Some(Value::Array(messages)) = body.get_mut("messages") else {
        return Err("no `messages` array".into());
    };
    let last_assistant = messages
        .last_mut()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"));
    match last_assistant {
        Some(Value::Object(m)) if continuing => match m.get_mut("content") {
            Some(Value::String(text)) => text.push_str(&g.text),
            _ => return Err("the final message to continue has no text content".into()),
        },
        _ => {
            let partial = serde_json::json!({"role": "assistant", "content": g.text});
            messages.push(partial);
        }
    }
    body.insert("continue_final_message".into(), Value::Bool(true));
    body.insert("add_generation_prompt".into(), Value::Bool(false));
    Ok(())
}

/// Rewrites a continuation's stream into the rest of the first answer.
#[derive(Debug)]
pub struct Splicer {
    /// The first answer's id, given to every event.
    id: Option<String>,
    /// A chat continuation's opening role chunk is dropped (once).
    drop_role: bool,
    /// Tokens generated before: added to the continuation's usage.
    before: u64,
    /// The client's prompt tokens, when known: the continuation's prompt
    /// holds the generated part too.
    prompt_tokens: Option<u64>,
    pending: Vec<u8>,
}

impl Splicer {
    /// A splicer after `generated`, for a prompt of `prompt_tokens`.
    pub fn new(generated: &Generated, endpoint: Endpoint, prompt_tokens: Option<u64>) -> Self {
        Splicer {
            id: generated.id.clone(),
            // The client has its role chunk when it has the answer's id.
            drop_role: endpoint == Endpoint::Chat && generated.id.is_some(),
            before: generated.tokens(),
            prompt_tokens,
            pending: Vec::new(),
        }
    }

    /// The continuation's next bytes, rewritten; whole events only (the
    /// rest waits for its blank line).
    pub fn feed(&mut self, chunk: &[u8]) -> Bytes {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(self.pending.len() + 64);
        let mut at = 0;
        while let Some(len) = crate::sse::event_end(&self.pending[at..]) {
            let event = self.pending[at..at + len].to_vec();
            at += len;
            self.rewrite(&event, &mut out);
        }
        self.pending.drain(..at);
        Bytes::from(out)
    }

    fn rewrite(&mut self, event: &[u8], out: &mut Vec<u8>) {
        for data in data_lines(event) {
            let Ok(Value::Object(mut doc)) = serde_json::from_str::<Value>(data) else {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(data.as_bytes());
                out.extend_from_slice(b"\n\n");
                continue;
            };
            if std::mem::take(&mut self.drop_role) && is_role_only(&doc) {
                continue;
            }
            if let Some(id) = &self.id {
                doc.insert("id".into(), Value::from(id.as_str()));
            }
            if let Some(Value::Object(usage)) = doc.get_mut("usage") {
                self.count_whole(usage);
            }
            out.extend_from_slice(b"data: ");
            let _ = serde_json::to_writer(&mut *out, &Value::Object(doc));
            out.extend_from_slice(b"\n\n");
        }
    }

    /// The continuation's usage made the whole answer's.
    fn count_whole(&self, usage: &mut Map<String, Value>) {
        let completion = usage
            .get("completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0)
            + self.before;
        let prompt = self.prompt_tokens.unwrap_or_else(|| {
            usage
                .get("prompt_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0)
                .saturating_sub(self.before)
        });
        usage.insert("completion_tokens".into(), completion.into());
        usage.insert("prompt_tokens".into(), prompt.into());
        usage.insert("total_tokens".into(), (prompt + completion).into());
    }
}

/// A chat chunk that only opens the assistant's message.
fn is_role_only(doc: &Map<String, Value>) -> bool {
    let Some(choice) = doc.get("choices").and_then(|c| c.get(0)) else {
        return false;
    };
    let delta = choice.get("delta");
    let content = delta
        .and_then(|d| d.get("content"))
        .and_then(Value::as_str)
        .unwrap_or("");
    delta.and_then(|d| d.get("role")).is_some()
        && content.is_empty()
        && choice.get("finish_reason").is_none_or(Value::is_null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn generated(text: &str, pieces: u64) -> Generated {
        Generated {
            id: Some("chatcmpl-1".into()),
            text: text.into(),
            pieces,
            ..Generated::default()
        }
    }

    fn body_of(c: Continuation) -> Value {
        match c {
            Continuation::Body(b) => serde_json::from_slice(&b).expect("json"),
            Continuation::Finished => panic!("finished"),
        }
    }

    #[test]
    fn a_chat_goes_on_from_its_partial_assistant_message() {
        let original = json!({"messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 64, "stream": true});
        let c = continuation(
            original.to_string().as_bytes(),
            Endpoint::Chat,
            &generated("Hello", 5),
        );
        let b = body_of(c.expect("continued"));
        assert_eq!(b["max_tokens"], 59);
        assert_eq!(
            b["messages"][1],
            json!({"role": "assistant", "content": "Hello"})
        );
        assert_eq!(b["continue_final_message"], true);
        assert_eq!(b["add_generation_prompt"], false);
    }

    #[test]
    fn a_completion_goes_on_from_its_text_or_its_token_ids() {
        let text = json!({"prompt": "once", "max_tokens": 8});
        let b = body_of(
            continuation(
                text.to_string().as_bytes(),
                Endpoint::Completions,
                &generated(" upon", 1),
            )
            .expect("continued"),
        );
        assert_eq!(
            (b["prompt"].clone(), b["max_tokens"].clone()),
            (json!("once upon"), json!(7))
        );
        let ids = json!({"prompt": [1, 2], "max_tokens": 8});
        let mut g = generated("x", 2);
        assert!(continuation(ids.to_string().as_bytes(), Endpoint::Completions, &g).is_err());
        g.token_ids = Some(vec![7, 9]);
        let b = body_of(
            continuation(ids.to_string().as_bytes(), Endpoint::Completions, &g).expect("ok"),
        );
        assert_eq!(b["prompt"], json!([1, 2, 7, 9]));
        assert_eq!(b["max_tokens"], 6);
    }

    #[test]
    fn nothing_generated_asks_again_whole_and_a_spent_budget_finishes() {
        let original = br#"{"prompt":"a","max_tokens":3}"#;
        let none = continuation(original, Endpoint::Completions, &generated("", 0));
        assert_eq!(none, Ok(Continuation::Body(original.to_vec())));
        let spent = continuation(original, Endpoint::Completions, &generated("abc", 3));
        assert_eq!(spent, Ok(Continuation::Finished));
        let n2 = br#"{"prompt":"a","n":2}"#;
        assert!(continuation(n2, Endpoint::Completions, &generated("b", 1)).is_err());
    }

    #[test]
    fn the_continuation_reads_as_the_rest_of_the_first_answer() {
        let mut s = Splicer::new(&generated("Hello", 5), Endpoint::Chat, Some(10));
        let stream = "data: {\"id\":\"chatcmpl-2\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
            data: {\"id\":\"chatcmpl-2\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" you\"}}]}\n\n\
            data: {\"id\":\"chatcmpl-2\",\"choices\":[],\"usage\":{\"prompt_tokens\":15,\"completion_tokens\":3,\"total_tokens\":18}}\n\n\
            data: [DONE]\n\n";
        let (a, b) = stream.split_at(40);
        let mut out = s.feed(a.as_bytes()).to_vec();
        out.extend_from_slice(&s.feed(b.as_bytes()));
        let text = String::from_utf8(out).expect("utf8");
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 3, "the role chunk is dropped: {text}");
        let piece: Value = serde_json::from_str(&events[0]["data: ".len()..]).expect("json");
        assert_eq!(piece["id"], "chatcmpl-1");
        assert_eq!(piece["choices"][0]["delta"]["content"], " you");
        let usage: Value = serde_json::from_str(&events[1]["data: ".len()..]).expect("json");
        assert_eq!(
            usage["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18})
        );
        assert_eq!(events[2], "data: [DONE]");
    }
}
