//! What each worker's `/v1/models` says, asked every 10 s: its context
//! length (`max_model_len`, which vLLM and SGLang both fill in), so that a
//! request that cannot fit is refused before it is sent (`--max-model-len`
//! stands in for workers that do not report one); and the models it serves,
//! base models and LoRA adapters alike (vLLM lists each loaded adapter as a
//! model with a `parent`), so that a request goes only to workers that
//! serve the model it names.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use serde_json::Value;
use tracing::debug;

use super::candidates::Target;
use super::Proxy;

/// Context lengths and served models learned from the workers, by worker name.
#[derive(Debug, Default)]
pub struct ContextLengths {
    by_worker: RwLock<HashMap<Arc<str>, u64>>,
    models: RwLock<HashMap<Arc<str>, Arc<[String]>>>,
    adapters: RwLock<HashMap<Arc<str>, Arc<[String]>>>,
}

impl ContextLengths {
    /// What `worker` reported, if anything.
    pub fn get(&self, worker: &str) -> Option<u64> {
        self.by_worker
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(worker)
            .copied()
    }

    fn set(&self, worker: Arc<str>, len: u64) {
        self.by_worker
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(worker, len);
    }

    /// The models `worker` listed last, if it ever answered.
    pub fn models_of(&self, worker: &str) -> Option<Arc<[String]>> {
        self.models
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(worker)
            .cloned()
    }

    fn set_models(&self, worker: Arc<str>, (ids, adapters): (Vec<String>, Vec<String>)) {
        self.models
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(worker.clone(), ids.into());
        self.adapters
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(worker, adapters.into());
    }

    /// Whether some worker lists `model` as a LoRA adapter (a model with a
    /// `parent`).
    pub fn is_adapter(&self, model: &str) -> bool {
        self.adapters
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .any(|list| list.iter().any(|a| a == model))
    }
}

/// The model ids a `/v1/models` document lists (at most 1 024), and of
/// them the LoRA adapters: those with a `parent` other than themselves.
fn model_ids(doc: &Value) -> Option<(Vec<String>, Vec<String>)> {
    let data = doc.get("data")?.as_array()?;
    let (mut ids, mut adapters) = (Vec::new(), Vec::new());
    for m in data.iter().take(1_024) {
        let Some(id) = m.get("id").and_then(Value::as_str) else {
            continue;
        };
        let parent = m.get("parent").and_then(Value::as_str);
        if parent.is_some_and(|p| p != id) {
            adapters.push(id.to_owned());
        }
        ids.push(id.to_owned());
    }
    Some((ids, adapters))
}

/// The smallest `max_model_len` a `/v1/models` document lists.
fn max_model_len(doc: &Value) -> Option<u64> {
    doc.get("data")?
        .as_array()?
        .iter()
        .filter_map(|m| m.get("max_model_len")?.as_u64())
        .min()
}

impl Proxy {
    /// Whether `target` serves `model`: its spec names it, or its
    /// `/v1/models` lists it. A worker that has said neither (no `model=`,
    /// no answer yet) is taken to serve any model, as before it was asked.
    pub fn serves(&self, target: &Target, model: &str) -> bool {
        let listed = self.context.models_of(&target.name);
        let named = target.model.as_deref();
        if named.is_none() && listed.is_none() {
            return true;
        }
        named == Some(model) || listed.is_some_and(|ids| ids.iter().any(|id| id == model))
    }

    /// The models `worker`'s `/v1/models` listed last (adapters included).
    pub fn listed_models(&self, worker: &str) -> Option<Arc<[String]>> {
        self.context.models_of(worker)
    }

    /// Whether any worker serves `model`.
    pub fn model_served(&self, model: &str) -> bool {
        self.targets().iter().any(|t| self.serves(t, model))
    }

    /// The context length to check requests to `target` against.
    pub fn context_length(&self, target: &Target) -> Option<u64> {
        self.context.get(&target.name).or(self.config.max_model_len)
    }

    /// Asks every worker for its `/v1/models` and remembers the context
    /// lengths they report (a worker that does not answer keeps what it
    /// said before).
    pub async fn learn_context_lengths(&self) {
        for t in self.targets().iter() {
            let answer = self
                .client
                .get(format!("{}/v1/models", t.url))
                .timeout(Duration::from_secs(2))
                .send()
                .await;
            let doc = match answer {
                Ok(r) if r.status().is_success() => r.json::<Value>().await.ok(),
                Ok(_) => None,
                Err(e) => {
                    debug!(worker = %t.name, error = %e, "no /v1/models answer");
                    None
                }
            };
            if let Some(len) = doc.as_ref().and_then(max_model_len) {
                self.context.set(t.name.clone(), len);
            }
            if let Some(ids) = doc.as_ref().and_then(model_ids) {
                self.context.set_models(t.name.clone(), ids);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_context_length_is_read_from_the_models_list() {
        let vllm = json!({"object": "list", "data": [{"id": "m", "max_model_len": 4096}]});
        assert_eq!(max_model_len(&vllm), Some(4096));
        let two = json!({"data": [{"id": "a", "max_model_len": 8192}, {"id": "b", "max_model_len": 2048}]});
        assert_eq!(max_model_len(&two), Some(2048));
        assert_eq!(max_model_len(&json!({"data": [{"id": "m"}]})), None);
        assert_eq!(max_model_len(&json!({"error": "x"})), None);
        let lora =
            json!({"data": [{"id": "base"}, {"id": "sql-lora", "parent": "base"}, {"x": 1}]});
        let (ids, adapters) = model_ids(&lora).expect("a list");
        assert_eq!(ids, ["base", "sql-lora"]);
        assert_eq!(adapters, ["sql-lora"]);
        assert_eq!(model_ids(&json!({"error": "x"})), None);
    }
}
