//! Each worker's context length, as it reports it (`max_model_len` in its
//! `/v1/models`, which vLLM and SGLang both fill in), so that a request that
//! cannot fit is refused before it is sent; `--max-model-len` stands in for
//! workers that do not report one.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use serde_json::Value;
use tracing::debug;

use super::candidates::Target;
use super::Proxy;

/// Context lengths learned from the workers, by worker name.
#[derive(Debug, Default)]
pub struct ContextLengths {
    by_worker: RwLock<HashMap<Arc<str>, u64>>,
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
    }
}
