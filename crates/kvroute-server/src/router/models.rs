//! What each worker's `/v1/models` says, asked when the worker is new and
//! then every 10 s (read within [`model_list`]'s bounds): its context
//! length (`max_model_len`, which vLLM and SGLang both fill in), so that a
//! request that cannot fit is refused before it is sent (`--max-model-len`
//! stands in for workers that do not report one); and the models it serves,
//! base models and LoRA adapters alike (vLLM lists each loaded adapter as a
//! model with a `parent`), so that a request goes only to workers known to
//! serve the model it names. Clients' `GET /v1/models` is answered from the
//! union of the lists learned, built once per change, never by asking the
//! workers while the client waits.
//!
//! A worker whose list is unknown (never answered, or answered something
//! over the bounds or not a list) gets no request naming a model its spec
//! does not name, unless no worker's list is known at all: a router that
//! has not heard from any worker yet (just started, or engines still
//! loading) routes as if each served every model, and the engines answer
//! for themselves.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use futures_util::StreamExt as _;
use tracing::{debug, warn};

use super::candidates::Target;
use super::Router;
use crate::model_list::{self, ListError, Model, MAX_LIST_BYTES};

/// How often a worker's `/v1/models` is asked.
pub const ASK_EVERY: Duration = Duration::from_secs(10);

/// Time allowed for a worker's whole `/v1/models` answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// Workers asked at once.
const ASKED_AT_ONCE: usize = 8;

/// What the router knows of a worker's models.
#[derive(Debug, Clone, Default)]
enum Listed {
    /// Never answered with a list.
    #[default]
    Unknown,
    /// Answered something over the bounds or not a list, last time.
    Refused,
    /// Its last list, in its order (ids, the adapters among them).
    Learned(Arc<[String]>, Arc<[Model]>),
}

/// A worker's name and the model its spec names: what the union and the
/// routing rule depend on besides the lists.
type WorkerNames = (Arc<str>, Option<Arc<str>>);

/// A worker's spec-named model and its list, if known.
type ListedModels<'a> = (Option<&'a str>, Option<Arc<[Model]>>);

/// One worker's answers.
#[derive(Debug, Default)]
struct Worker {
    asked: Option<Instant>,
    context_length: Option<u64>,
    listed: Listed,
}

/// Context lengths and served models learned from the workers, by worker
/// name, and the union clients are answered with.
#[derive(Debug)]
pub struct WorkerModels {
    workers: RwLock<HashMap<Arc<str>, Worker>>,
    /// Whether some current worker's list is known.
    any_learned: AtomicBool,
    /// A round of asking ended since the last rebuild.
    changed: AtomicBool,
    /// The workers (and the models their specs name) of the last rebuild.
    rebuilt_for: Mutex<Vec<WorkerNames>>,
    /// `GET /v1/models`' answer.
    union: RwLock<Bytes>,
}

impl Default for WorkerModels {
    fn default() -> Self {
        WorkerModels {
            workers: RwLock::default(),
            any_learned: AtomicBool::new(false),
            changed: AtomicBool::new(false),
            rebuilt_for: Mutex::default(),
            union: RwLock::new(model_list::union_answer([]).0),
        }
    }
}

impl WorkerModels {
    /// What `worker` reported, if anything.
    pub fn get(&self, worker: &str) -> Option<u64> {
        self.read().get(worker).and_then(|w| w.context_length)
    }

    /// The models `worker` listed last, if its list is known.
    pub fn models_of(&self, worker: &str) -> Option<Arc<[String]>> {
        match self.read().get(worker).map(|w| &w.listed) {
            Some(Listed::Learned(ids, _)) => Some(ids.clone()),
            _ => None,
        }
    }

    /// Whether some current worker's list is known (see the module docs).
    pub fn any_learned(&self) -> bool {
        self.any_learned.load(Ordering::Relaxed)
    }

    /// Every model the workers' learned lists hold, by id (the first
    /// worker's entry for each), for what the router learns about each
    /// model itself (its tokenizer).
    pub fn learned_models(&self) -> Vec<Model> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for w in self.read().values() {
            if let Listed::Learned(_, models) = &w.listed {
                for m in models.iter() {
                    if seen.insert(m.id.clone()) {
                        out.push(m.clone());
                    }
                }
            }
        }
        out
    }

    /// Where the engines loaded `model`'s weights from (its `root`; a LoRA
    /// adapter's base model's), as the first worker listing it says.
    pub fn root_of(&self, model: &str) -> Option<String> {
        let models = self.learned_models();
        let listed = models.iter().find(|m| m.id == model)?;
        let base = match (&listed.parent, listed.adapter) {
            (Some(parent), true) => models.iter().find(|m| &m.id == parent)?,
            _ => listed,
        };
        base.root.clone()
    }

    /// Whether some worker lists `model` as a LoRA adapter (a model with a
    /// `parent`).
    pub fn is_adapter(&self, model: &str) -> bool {
        self.read().values().any(|w| match &w.listed {
            Listed::Learned(_, models) => models.iter().any(|m| m.adapter && m.id == model),
            _ => false,
        })
    }

    /// The answer to a client's `GET /v1/models`.
    pub fn union(&self) -> Bytes {
        self.union
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether `worker` is to be asked now (never asked, or not for
    /// [`ASK_EVERY`]); marks it asked if so.
    fn due(&self, worker: &Arc<str>, now: Instant) -> bool {
        let mut workers = self.write();
        let w = workers.entry(worker.clone()).or_default();
        let due = w.asked.is_none_or(|at| now.duration_since(at) >= ASK_EVERY);
        if due {
            w.asked = Some(now);
        }
        due
    }

    /// Records `worker`'s answer: a list learned (and its context length),
    /// or refused; `false` when it was refused. What depends on every
    /// worker's list is rebuilt at the end of the round
    /// ([`WorkerModels::rebuild`]), so that the answers of one round
    /// take effect together.
    fn record(&self, worker: &Arc<str>, answer: Result<Vec<Model>, ListError>) -> bool {
        let mut workers = self.write();
        let w = workers.entry(worker.clone()).or_default();
        match answer {
            Ok(models) => {
                if let Some(len) = model_list::max_model_len(&models) {
                    w.context_length = Some(len);
                }
                let ids: Arc<[String]> = models.iter().map(|m| m.id.clone()).collect();
                w.listed = Listed::Learned(ids, models.into());
                true
            }
            Err(e) => {
                if !matches!(w.listed, Listed::Refused) {
                    warn!(
                        worker = %worker, error = %e,
                        "the worker's /v1/models is not a list within bounds: it gets no \
                         request naming a model until it answers one"
                    );
                }
                w.listed = Listed::Refused;
                false
            }
        }
    }

    /// Forgets workers that are gone, and rebuilds what depends on the
    /// current workers' lists, whether any is known and the union, when
    /// an answer was recorded or the workers changed since the last time.
    /// The workers are read from `current` once the rebuilds before are
    /// done, so the last rebuild always sees the last workers.
    fn rebuild(&self, current: impl FnOnce() -> Arc<Vec<Target>>) {
        let mut last = self
            .rebuilt_for
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let targets = current();
        let names: Vec<WorkerNames> = targets
            .iter()
            .map(|t| (t.name.clone(), t.model.clone()))
            .collect();
        if !self.changed.swap(false, Ordering::Relaxed) && *last == names {
            return;
        }
        *last = names;
        let mut workers = self.write();
        let current: HashSet<&str> = targets.iter().map(|t| &*t.name).collect();
        workers.retain(|name, _| current.contains(&**name));
        let learned = |t: &Target| match workers.get(&t.name).map(|w| &w.listed) {
            Some(Listed::Learned(_, models)) => Some(models.clone()),
            _ => None,
        };
        let lists: Vec<ListedModels> = targets
            .iter()
            .map(|t| (t.model.as_deref(), learned(t)))
            .collect();
        drop(workers);
        let any = lists.iter().any(|(_, list)| list.is_some());
        self.any_learned.store(any, Ordering::Relaxed);
        let mut seen = HashSet::new();
        let mut cards = Vec::new();
        for (_, list) in &lists {
            for m in list.iter().flat_map(|l| l.iter()) {
                if seen.insert(m.id.as_str()) {
                    cards.push(m.card.clone());
                }
            }
        }
        for named in lists.iter().filter_map(|(named, _)| *named) {
            if seen.insert(named) {
                cards.push(model_list::bare_card(named, None, None));
            }
        }
        let (answer, left_out) = model_list::union_answer(cards.iter().map(|c| c.as_ref()));
        if left_out > 0 {
            warn!(
                left_out,
                "the union of the workers' models is over its bound; some left out"
            );
        }
        *self.union.write().unwrap_or_else(PoisonError::into_inner) = answer;
        drop(last);
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<Arc<str>, Worker>> {
        self.workers.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<Arc<str>, Worker>> {
        self.workers.write().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Router {
    /// Every model the workers' learned lists hold.
    pub(crate) fn learned_models(&self) -> Vec<model_list::Model> {
        self.models.learned_models()
    }

    /// Where the engines loaded `model` from ([`WorkerModels::root_of`]):
    /// what vLLM names a request's images with.
    pub(crate) fn model_root(&self, model: &str) -> Option<String> {
        self.models.root_of(model)
    }

    /// The URLs of the workers that serve `model`, in the workers' order.
    pub(crate) fn urls_serving(&self, model: &str) -> Vec<String> {
        self.targets()
            .iter()
            .filter(|t| self.serves(t, model))
            .map(|t| t.url.clone())
            .collect()
    }

    /// The one model every worker's list holds, when there is exactly one
    /// (what a request that names none is taken to ask for).
    pub(crate) fn only_model(&self) -> Option<String> {
        let models = self.models.learned_models();
        match models.as_slice() {
            [one] => Some(one.id.clone()),
            _ => None,
        }
    }

    /// Whether `target` serves `model`: its spec names it, or its
    /// `/v1/models` lists it; a worker whose list is unknown and whose spec
    /// names no model only while no worker's list is known (see the module
    /// docs).
    pub fn serves(&self, target: &Target, model: &str) -> bool {
        let listed = self.models.models_of(&target.name);
        let known = self.models.any_learned();
        serves_model(target.model.as_deref(), listed.as_deref(), known, model)
    }

    /// The models `worker`'s `/v1/models` listed last (adapters included).
    pub fn listed_models(&self, worker: &str) -> Option<Arc<[String]>> {
        self.models.models_of(worker)
    }

    /// Whether any worker serves `model`.
    pub fn model_served(&self, model: &str) -> bool {
        self.targets().iter().any(|t| self.serves(t, model))
    }

    /// The context length to check requests to `target` against.
    pub fn context_length(&self, target: &Target) -> Option<u64> {
        self.models.get(&target.name).or(self.config.max_model_len)
    }

    /// Rebuilds what depends on every current worker's list, if an answer
    /// came or the workers changed since the last time (see the module
    /// docs): called at the end of each round of asking, and when the
    /// workers change.
    pub fn rebuild_models(&self) {
        self.models.rebuild(|| self.targets());
    }

    /// The answer to a client's `GET /v1/models`: the union of the lists
    /// learned (and the models specs name), as last built.
    pub fn models_answer(&self) -> Bytes {
        self.models.union()
    }

    /// Asks each worker that is due (new, or not asked for [`ASK_EVERY`])
    /// for its `/v1/models`, a few at once, and remembers what they say (a
    /// worker that does not answer keeps what it said before); then forgets
    /// workers that are gone and rebuilds the union. Called every second.
    pub async fn learn_context_lengths(&self) {
        let targets = self.targets();
        let now = Instant::now();
        let due: Vec<&Target> = targets
            .iter()
            .filter(|t| self.models.due(&t.name, now))
            .collect();
        futures_util::stream::iter(due)
            .for_each_concurrent(ASKED_AT_ONCE, |t| async move {
                if let Some(answer) = self.ask_models(t).await {
                    if !self.models.record(&t.name, answer) {
                        self.metrics.model_lists_refused.inc();
                    }
                }
            })
            .await;
        self.models.changed.store(true, Ordering::Relaxed);
        self.rebuild_models();
    }

    /// `target`'s `/v1/models`: `None` when it gave no answer (unreachable,
    /// not a success, or not within [`ASK_TIMEOUT`]), else the list or why
    /// it is refused.
    async fn ask_models(&self, target: &Target) -> Option<Result<Vec<Model>, ListError>> {
        let answer = self
            .client
            .get(format!("{}/v1/models", target.url))
            .timeout(ASK_TIMEOUT)
            .send()
            .await;
        let resp = match answer {
            Ok(r) if r.status().is_success() => r,
            Ok(r) => {
                debug!(worker = %target.name, status = %r.status(), "no /v1/models list");
                return None;
            }
            Err(e) => {
                debug!(worker = %target.name, error = %e, "no /v1/models answer");
                return None;
            }
        };
        match model_list::read_capped(resp, MAX_LIST_BYTES).await {
            Ok(body) => Some(model_list::parse_list(&body)),
            Err(ListError::Read(e)) => {
                debug!(worker = %target.name, error = %e, "/v1/models answer cut off");
                None
            }
            Err(e) => Some(Err(e)),
        }
    }
}

/// Whether a worker serves `model`: the model its spec `named`, or one its
/// `listed` models hold; a worker whose list is unknown and whose spec
/// names none, only while no worker's list is known (`any_known`).
fn serves_model(
    named: Option<&str>,
    listed: Option<&[String]>,
    any_known: bool,
    model: &str,
) -> bool {
    if named == Some(model) {
        return true;
    }
    match listed {
        Some(ids) => ids.iter().any(|id| id == model),
        None => named.is_none() && !any_known,
    }
}

#[cfg(test)]
mod tests {
    use super::serves_model;

    #[test]
    fn a_worker_serves_what_it_is_known_to_and_unknown_ones_only_while_nothing_is_known() {
        let alpha = ["alpha".to_owned(), "sql".to_owned()];
        // Listed: exactly its list (and its spec's model).
        assert!(serves_model(None, Some(&alpha), true, "sql"));
        assert!(!serves_model(None, Some(&alpha), true, "gamma"));
        assert!(serves_model(Some("gamma"), Some(&alpha), true, "gamma"));
        // Named by its spec, no list: that model alone.
        assert!(serves_model(Some("gamma"), None, false, "gamma"));
        assert!(!serves_model(Some("gamma"), None, false, "alpha"));
        // Unknown: anything while no list is known, nothing after.
        assert!(serves_model(None, None, false, "anything"));
        assert!(!serves_model(None, None, true, "anything"));
    }
}
