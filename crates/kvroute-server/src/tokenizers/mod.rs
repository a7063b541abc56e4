//! Each model's tokenizer and chat template, found by the router itself so
//! that no operator has to know `--tokenizer`: for every model the workers'
//! `/v1/models` list, in this order,
//!
//! 1. its `root` (where the engine loaded it from), when that is a folder
//!    the router can read;
//! 2. the Hugging Face cache, by `root` and by model id ([`hub`]);
//! 3. a download from the hub into that cache, when the machine is online
//!    (`HF_HUB_OFFLINE` unset; `HF_TOKEN`, `HF_ENDPOINT` honoured);
//! 4. for a LoRA adapter, its base model's;
//! 5. the engine's own `POST /tokenize` ([`engine`]): exact by construction,
//!    at a round trip per request.
//!
//! A tokenizer found in 1–4 is checked against the engine's `/tokenize` on
//! a probe chat when the engine serves one: if they differ, the engine's is
//! used. `--tokenizer` and `--model NAME=FILE` still decide for the models
//! they cover. A model none of these serves is routed on load alone, and
//! the router says so once, loudly, naming the model and the fix; its state
//! is in `/workers`, the dashboard and `kvroute_model_tokenizer`.
//! `--tokenizer-sources` narrows the list.

pub mod engine;
pub mod hub;
pub mod media;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use kvroute_prompt::{ImageTokenRule, Prompt, Renderer, Tokenizer};
use serde_json::{json, Value};
use tracing::{info, warn};

use crate::model_list::Model;
use hub::HubConfig;

/// Where a model's tokenizer may be looked for (`--tokenizer-sources`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceKind {
    /// The engine's `root` folder.
    Root,
    /// The Hugging Face cache.
    Cache,
    /// A download from the hub.
    Hub,
    /// The engine's `/tokenize`.
    Engine,
}

impl SourceKind {
    /// Every source, in the order they are tried.
    pub const ALL: [SourceKind; 4] = [
        SourceKind::Root,
        SourceKind::Cache,
        SourceKind::Hub,
        SourceKind::Engine,
    ];

    /// Its name in `--tokenizer-sources`.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::Root => "root",
            SourceKind::Cache => "cache",
            SourceKind::Hub => "hub",
            SourceKind::Engine => "engine",
        }
    }
}

impl std::str::FromStr for SourceKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        SourceKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| format!("`{s}`: a tokenizer source is root, cache, hub or engine"))
    }
}

/// How the router finds tokenizers.
#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    /// The sources tried, in [`SourceKind::ALL`]'s order (empty: none).
    pub sources: Vec<SourceKind>,
    /// The hub and its cache.
    pub hub: HubConfig,
    /// Positions per image in prompts the found tokenizers render.
    pub image_rule: ImageTokenRule,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            sources: SourceKind::ALL.to_vec(),
            hub: HubConfig::from_env(|_| None),
            image_rule: ImageTokenRule::default(),
        }
    }
}

/// Where a model's tokens come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// A tokenizer file: the source it was found by and where.
    File(SourceKind, PathBuf),
    /// The base model's, for a LoRA adapter.
    Parent(String),
    /// The engine's `/tokenize`.
    Engine,
    /// Nowhere: routed on load alone.
    Nowhere,
}

impl Found {
    /// Its name in `/workers`, the dashboard and the metric's label.
    pub fn label(&self) -> &'static str {
        match self {
            Found::File(kind, _) => kind.as_str(),
            Found::Parent(_) => "parent",
            Found::Engine => "engine",
            Found::Nowhere => "none",
        }
    }
}

/// One model's entry.
#[derive(Debug, Clone)]
struct Entry {
    found: Found,
    renderer: Option<Arc<Renderer>>,
    /// The model's image placeholders, for a vision-language model whose
    /// configuration the router could read.
    media: Option<media::MediaTokens>,
    at: Instant,
}

/// How long a model found nowhere waits before it is looked for again.
const RETRY_NOWHERE: Duration = Duration::from_secs(60);

/// The most `/tokenize` answers' ids kept.
const ENGINE_CACHE_TOKENS: usize = 4 << 20;

/// Every model's tokenizer, as found.
#[derive(Debug)]
pub struct ModelTokenizers {
    config: DiscoveryConfig,
    table: RwLock<HashMap<String, Entry>>,
    /// Models being looked for now.
    pending: Mutex<HashSet<String>>,
    /// Woken whenever a look ends, for requests waiting on one.
    looked: tokio::sync::Notify,
    /// `/tokenize` answers.
    pub answers: engine::AnswerCache,
}

/// The longest a request waits for a tokenizer being looked for: the first
/// requests after a start are tokenized with what the look finds, not
/// routed on load alone, while a slow download does not hold them long.
pub const LOOK_WAIT: Duration = Duration::from_secs(5);

/// What the discovery of one model may ask of the rest of the router.
pub struct Asker<'a> {
    /// The HTTP client.
    pub client: &'a reqwest::Client,
    /// The URLs of the workers serving the model.
    pub urls: Vec<String>,
}

impl ModelTokenizers {
    /// A table with nothing found yet.
    pub fn new(config: DiscoveryConfig) -> Self {
        ModelTokenizers {
            config,
            table: RwLock::default(),
            pending: Mutex::default(),
            looked: tokio::sync::Notify::new(),
            answers: engine::AnswerCache::new(ENGINE_CACHE_TOKENS),
        }
    }

    /// The renderer found for `model`, if a file was.
    pub fn renderer(&self, model: &str) -> Option<Arc<Renderer>> {
        self.read().get(model).and_then(|e| e.renderer.clone())
    }

    /// The image placeholders of `model`, when it is a vision-language
    /// model whose `config.json` was found beside its tokenizer or in its
    /// root: its chats with images are tokenized by its engine, which
    /// knows how many positions each image takes ([`media`]).
    pub fn media(&self, model: &str) -> Option<media::MediaTokens> {
        self.read().get(model).and_then(|e| e.media)
    }

    /// Whether `model`'s tokens come from the engine's `/tokenize`.
    pub fn uses_engine(&self, model: &str) -> bool {
        self.read()
            .get(model)
            .is_some_and(|e| e.found == Found::Engine)
    }

    /// Every model's source, by id, in order.
    pub fn snapshot(&self) -> Vec<(String, Found)> {
        let mut all: Vec<(String, Found)> = self
            .read()
            .iter()
            .map(|(m, e)| (m.clone(), e.found.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// The models of `learned` due a look: never looked for, or found
    /// nowhere a while ago; marked pending.
    pub fn due(&self, learned: &[Model], now: Instant) -> Vec<Model> {
        let table = self.read();
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        learned
            .iter()
            .filter(|m| match table.get(&m.id) {
                None => true,
                Some(e) => e.found == Found::Nowhere && now.duration_since(e.at) >= RETRY_NOWHERE,
            })
            .filter(|m| pending.insert(m.id.clone()))
            .cloned()
            .collect()
    }

    /// Looks for `model`'s tokenizer (see the module docs) and records what
    /// was found; logs it, and warns when nothing was.
    pub async fn discover(&self, model: &Model, asker: Asker<'_>) {
        let looked = self.look(model, &asker).await;
        let (found, renderer) = match looked {
            Some((found, renderer)) => self.checked(model, found, renderer, &asker).await,
            None => (self.engine_or_nowhere(model, &asker).await, None),
        };
        let before = self.read().get(&model.id).map(|e| e.found.clone());
        match &found {
            Found::Nowhere if before.as_ref() != Some(&Found::Nowhere) => warn!(
                model = %model.id,
                root = model.root.as_deref().unwrap_or("-"),
                "NO TOKENIZER for model `{}`: its text requests are routed on load alone, \
                 blind to what the engines cache. The router could not read its root, found it \
                 in no Hugging Face cache ({}), could not download it{}, and its engines do not \
                 answer /tokenize. Fix: give --model {}=/path/to/tokenizer.json (or mount the \
                 model folder or the Hugging Face cache where the router runs).",
                model.id,
                self.config.hub.cache.display(),
                if self.config.hub.offline { " (HF_HUB_OFFLINE is set)" } else { "" },
                model.id
            ),
            Found::Nowhere => {}
            other => {
                info!(model = %model.id, source = other.label(), found = ?other, "tokenizer found")
            }
        }
        let media = media_of(model, &found);
        let entry = Entry {
            found,
            renderer,
            media,
            at: Instant::now(),
        };
        self.write().insert(model.id.clone(), entry);
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&model.id);
        self.looked.notify_waiters();
    }

    /// Waits, at most `limit`, until no tokenizer is being looked for: a
    /// request that arrives while its model's look runs (just after a
    /// start) is tokenized with what it finds. Returns at once when no look
    /// runs.
    pub async fn settled(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.looked.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let looking = !self
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty();
            if !looking || tokio::time::timeout_at(deadline, notified).await.is_err() {
                return;
            }
        }
    }

    /// A tokenizer file for `model` from the sources allowed, or its base
    /// model's renderer.
    async fn look(&self, model: &Model, asker: &Asker<'_>) -> Option<(Found, Arc<Renderer>)> {
        let allowed = |k: SourceKind| self.config.sources.contains(&k);
        let root = model.root.as_deref();
        let ids: Vec<&str> = root
            .into_iter()
            .chain([model.id.as_str()])
            .filter(|id| hub::is_repo_id(id))
            .collect();
        let mut files: Vec<(SourceKind, PathBuf)> = Vec::new();
        if allowed(SourceKind::Root) {
            if let Some(dir) = root.map(Path::new).filter(|d| d.is_absolute()) {
                files.push((SourceKind::Root, dir.join(hub::FILES[0])));
            }
        }
        if allowed(SourceKind::Cache) {
            let cache = &self.config.hub.cache;
            files.extend(
                ids.iter()
                    .filter_map(|id| hub::cached_tokenizer(cache, id))
                    .map(|f| (SourceKind::Cache, f)),
            );
        }
        for (kind, file) in files {
            if let Some(renderer) = self.load(&file).await {
                return Some((Found::File(kind, file), renderer));
            }
        }
        if allowed(SourceKind::Hub) && !self.config.hub.offline {
            for id in &ids {
                match hub::fetch(asker.client, &self.config.hub, id).await {
                    Ok(file) => {
                        if let Some(renderer) = self.load(&file).await {
                            return Some((Found::File(SourceKind::Hub, file), renderer));
                        }
                    }
                    Err(e) => {
                        tracing::debug!(model = %model.id, repo = id, error = %e, "not from the hub")
                    }
                }
            }
        }
        let parent = model.parent.as_deref()?;
        let renderer = self.renderer(parent)?;
        Some((Found::Parent(parent.to_owned()), renderer))
    }

    /// The renderer of the tokenizer file at `file` (and the chat template
    /// beside it), read off the runtime; `None` when it is not there or
    /// does not load.
    async fn load(&self, file: &Path) -> Option<Arc<Renderer>> {
        if !file.is_file() {
            return None;
        }
        let (path, rule) = (file.to_owned(), self.config.image_rule);
        let loaded = tokio::task::spawn_blocking(move || Tokenizer::from_file(&path)).await;
        match loaded {
            Ok(Ok(tokenizer)) => Some(Arc::new(Renderer::new(tokenizer, rule))),
            Ok(Err(e)) => {
                warn!(file = %file.display(), error = %e, "a tokenizer file did not load");
                None
            }
            Err(_) => None,
        }
    }

    /// `found` as it stands against the engine's `/tokenize` on a probe
    /// chat: kept when they agree or no engine answers, replaced by the
    /// engine when they differ.
    async fn checked(
        &self,
        model: &Model,
        found: Found,
        renderer: Arc<Renderer>,
        asker: &Asker<'_>,
    ) -> (Found, Option<Arc<Renderer>>) {
        let messages = probe_messages();
        let body = json!({"model": model.id, "messages": messages});
        let Some(engine) = first_answer(asker, &body).await else {
            return (found, Some(renderer));
        };
        let ours = Prompt::chat(Some(&messages))
            .and_then(|p| renderer.render_for_routing(&p))
            .map(|p| p.tokens);
        if ours.as_ref().is_ok_and(|t| *t == engine) {
            return (found, Some(renderer));
        }
        let allowed = self.config.sources.contains(&SourceKind::Engine);
        warn!(
            model = %model.id, found = ?found,
            "the tokenizer found for `{}` renders a probe chat differently from its engine's \
             /tokenize: {}",
            model.id,
            if allowed { "the engine's is used" } else { "kept, as --tokenizer-sources has no engine" }
        );
        if allowed {
            (Found::Engine, None)
        } else {
            (found, Some(renderer))
        }
    }

    /// [`Found::Engine`] when an engine of the model answers `/tokenize`
    /// (and the source is allowed), else [`Found::Nowhere`].
    async fn engine_or_nowhere(&self, model: &Model, asker: &Asker<'_>) -> Found {
        if !self.config.sources.contains(&SourceKind::Engine) {
            return Found::Nowhere;
        }
        let body = json!({"model": model.id, "messages": probe_messages()});
        match first_answer(asker, &body).await {
            Some(_) => Found::Engine,
            None => Found::Nowhere,
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Entry>> {
        self.table.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Entry>> {
        self.table.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Every model's tokenizer as `/workers` and `/api/stats` show it: the
/// model, where its tokens come from (`root`, `cache`, `hub`, `parent`,
/// `engine`, or `none`: routed on load alone) and, for a file, its path.
pub fn tokenizers_json(tokenizers: &ModelTokenizers) -> Value {
    let rows: Vec<Value> = tokenizers
        .snapshot()
        .into_iter()
        .map(|(model, found)| {
            let from = match &found {
                Found::File(_, path) => Value::from(path.display().to_string()),
                Found::Parent(parent) => Value::from(parent.as_str()),
                Found::Engine | Found::Nowhere => Value::Null,
            };
            json!({"model": model, "source": found.label(), "from": from})
        })
        .collect();
    Value::Array(rows)
}

/// `kvroute_model_tokenizer{model,source}` (1 for each model the workers
/// list, by where its tokens come from).
#[derive(Debug)]
pub struct TokenizerCollector(pub Arc<ModelTokenizers>);

impl prometheus_client::collector::Collector for TokenizerCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric as _;
        let info = crate::metrics::catalogue::MODEL_TOKENIZER;
        let mut family =
            encoder.encode_descriptor(info.family(), info.help, None, info.kind.metric_type())?;
        for (model, found) in self.0.snapshot() {
            let labels = [("model", model), ("source", found.label().to_owned())];
            let metric = family.encode_family(&labels)?;
            prometheus_client::metrics::gauge::ConstGauge::new(1i64).encode(metric)?;
        }
        Ok(())
    }
}

/// The image placeholders in the `config.json` of `model`'s root folder,
/// or beside the tokenizer file found for it.
fn media_of(model: &Model, found: &Found) -> Option<media::MediaTokens> {
    let root = model
        .root
        .as_deref()
        .map(Path::new)
        .filter(|d| d.is_absolute());
    let beside = match found {
        Found::File(_, file) => file.parent(),
        _ => None,
    };
    root.into_iter()
        .chain(beside)
        .find_map(media::MediaTokens::read)
}

/// The chat every found tokenizer is checked on: roles, punctuation,
/// digits and a generation prompt.
fn probe_messages() -> Value {
    json!([
        {"role": "system", "content": "You route requests."},
        {"role": "user", "content": "Hello, world! 12345 w16 w17"},
    ])
}

/// The first answer of the model's workers' `/tokenize` to `body`.
async fn first_answer(asker: &Asker<'_>, body: &Value) -> Option<Vec<u32>> {
    for url in &asker.urls {
        if let Ok(tokens) = engine::ask(asker.client, url, body).await {
            return Some(tokens);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_named_as_the_flag_names_them() {
        for kind in SourceKind::ALL {
            assert_eq!(kind.as_str().parse::<SourceKind>(), Ok(kind));
        }
        assert!("disk".parse::<SourceKind>().is_err());
        assert_eq!(Found::Nowhere.label(), "none");
        assert_eq!(
            Found::File(SourceKind::Cache, PathBuf::new()).label(),
            "cache"
        );
    }
}
