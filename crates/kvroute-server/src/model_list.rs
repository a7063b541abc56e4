//! A worker's `/v1/models` answer, read within bounds: at most
//! [`MAX_LIST_BYTES`] of body (enforced while reading, so a worker cannot
//! make the router buffer more), at most [`MAX_MODELS`] models, ids of at
//! most [`MAX_ID`] bytes, and each model's card as the worker wrote it up to
//! [`MAX_CARD`] bytes (a shorter card in its place beyond). And the union
//! of the lists learned, built once per change, that `GET /v1/models`
//! answers clients with.

use axum::body::Bytes;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// The most of a `/v1/models` body read; a longer one is refused whole.
pub const MAX_LIST_BYTES: usize = 4 << 20;

/// The most models taken from one list (the rest are ignored).
pub const MAX_MODELS: usize = 1_024;

/// The longest model id taken (a longer one is skipped).
pub const MAX_ID: usize = 1_024;

/// The longest model card passed on to clients as the worker wrote it.
pub const MAX_CARD: usize = 2_048;

/// The most the union answered to clients holds (further models are left
/// out, with a warning).
pub const MAX_UNION_BYTES: usize = 4 << 20;

/// Why a worker's answer is not a list the router can use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ListError {
    /// The body is longer than [`MAX_LIST_BYTES`].
    #[error("the answer is over {} bytes", MAX_LIST_BYTES)]
    TooLarge,
    /// Not JSON with a `data` array.
    #[error("not a model list: {0}")]
    NotAList(String),
    /// The body could not be read.
    #[error("reading the answer failed: {0}")]
    Read(String),
}

/// One model a worker lists.
#[derive(Debug, Clone)]
pub struct Model {
    /// Its id.
    pub id: String,
    /// Whether it is a LoRA adapter: a model with a `parent` other than itself.
    pub adapter: bool,
    /// Its context length, when given.
    pub max_model_len: Option<u64>,
    /// The adapter's base model, for a LoRA adapter.
    pub parent: Option<String>,
    /// Where the engine loaded it from (vLLM's and SGLang's `root`: a
    /// directory, or a Hugging Face repository id), when given and at most
    /// [`MAX_ID`] bytes: where the router looks for its tokenizer.
    pub root: Option<String>,
    /// Its card, as JSON text, for clients.
    pub card: Box<RawValue>,
}

/// Reads `resp`'s body, refusing it as soon as it is over `cap` bytes (by
/// its `content-length`, or while reading): never buffers more than `cap`
/// plus one chunk.
pub async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Result<Vec<u8>, ListError> {
    if resp.content_length().is_some_and(|n| n > cap as u64) {
        return Err(ListError::TooLarge);
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| ListError::Read(e.to_string()))?
    {
        if body.len() + chunk.len() > cap {
            return Err(ListError::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The models a `/v1/models` body lists: the first [`MAX_MODELS`] entries
/// with a string `id` of 1 to [`MAX_ID`] bytes (the rest are skipped
/// without being kept).
pub fn parse_list(body: &[u8]) -> Result<Vec<Model>, ListError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let list = ListDoc::deserialize(&mut de).map_err(|e| ListError::NotAList(e.to_string()))?;
    de.end().map_err(|e| ListError::NotAList(e.to_string()))?;
    list.0
        .ok_or_else(|| ListError::NotAList("no `data` array".to_owned()))
}

/// The smallest context length `models` give.
pub fn max_model_len(models: &[Model]) -> Option<u64> {
    models.iter().filter_map(|m| m.max_model_len).min()
}

/// `{"object": "list", "data": [cards…]}` of `cards` (each a JSON object),
/// those after [`MAX_UNION_BYTES`] left out; and how many were.
pub fn union_answer<'a>(cards: impl IntoIterator<Item = &'a RawValue>) -> (Bytes, usize) {
    let mut out = String::from(r#"{"object":"list","data":["#);
    let mut left_out = 0;
    let mut first = true;
    for card in cards {
        if out.len() + card.get().len() + 3 > MAX_UNION_BYTES {
            left_out += 1;
            continue;
        }
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(card.get());
    }
    out.push_str("]}");
    (Bytes::from(out), left_out)
}

/// A short card for a model known by its id alone.
pub fn bare_card(id: &str, parent: Option<&str>, max_model_len: Option<u64>) -> Box<RawValue> {
    let mut card = serde_json::json!({"id": id, "object": "model", "owned_by": "kvroute"});
    if let Some(p) = parent {
        card["parent"] = p.into();
    }
    if let Some(len) = max_model_len {
        card["max_model_len"] = len.into();
    }
    // Serializing a `Value` cannot fail; `null` would stand in if it did.
    serde_json::value::to_raw_value(&card).unwrap_or_default()
}

/// The document: its `data` when it is an array (other fields ignored).
struct ListDoc(Option<Vec<Model>>);

impl<'de> Deserialize<'de> for ListDoc {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(DocVisitor)
    }
}

struct DocVisitor;

impl<'de> Visitor<'de> for DocVisitor {
    type Value = ListDoc;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ListDoc, A::Error> {
        let mut data = None;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if key == "data" && data.is_none() {
                data = map.next_value_seed(DataSeed)?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(ListDoc(data))
    }
}

/// `data`: the first [`MAX_MODELS`] usable entries of an array, the rest
/// skipped; `None` for anything but an array.
struct DataSeed;

impl<'de> DeserializeSeed<'de> for DataSeed {
    type Value = Option<Vec<Model>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(DataVisitor)
    }
}

struct DataVisitor;

impl<'de> Visitor<'de> for DataVisitor {
    type Value = Option<Vec<Model>>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of models")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut models = Vec::new();
        while models.len() < MAX_MODELS {
            match seq.next_element::<&'de RawValue>() {
                Ok(Some(raw)) => models.extend(model_of(raw)),
                Ok(None) => return Ok(Some(models)),
                // An entry that is not borrowable text (never from a slice).
                Err(e) => return Err(e),
            }
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Some(models))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// The fields of an entry the router reads.
#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(borrow, default)]
    id: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    parent: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    max_model_len: Option<u64>,
    #[serde(borrow, default)]
    root: Option<std::borrow::Cow<'a, str>>,
}

/// The model an entry describes, if it is an object with a usable id.
fn model_of(raw: &RawValue) -> Option<Model> {
    let fields: Fields = serde_json::from_str(raw.get()).ok()?;
    let id = fields.id?;
    if id.is_empty() || id.len() > MAX_ID {
        return None;
    }
    let parent = fields.parent.as_deref();
    let card = if raw.get().len() <= MAX_CARD {
        raw.to_owned()
    } else {
        bare_card(&id, parent, fields.max_model_len)
    };
    let adapter = parent.is_some_and(|p| p != id);
    let short = |s: Option<std::borrow::Cow<'_, str>>| {
        s.filter(|s| !s.is_empty() && s.len() <= MAX_ID)
            .map(|s| s.into_owned())
    };
    Some(Model {
        adapter,
        max_model_len: fields.max_model_len,
        parent: if adapter { short(fields.parent) } else { None },
        root: short(fields.root),
        id: id.into_owned(),
        card,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ids(models: &[Model]) -> Vec<&str> {
        models.iter().map(|m| m.id.as_str()).collect()
    }

    #[test]
    fn a_list_gives_its_models_adapters_and_context_length() {
        let vllm = json!({"object": "list", "data": [
            {"id": "base", "max_model_len": 8192, "permission": [{"x": 1}]},
            {"id": "sql-lora", "parent": "base", "max_model_len": 2048},
            {"x": 1}, {"id": ""}, {"id": 5}, "text"
        ]});
        let models = parse_list(vllm.to_string().as_bytes()).expect("a list");
        assert_eq!(ids(&models), ["base", "sql-lora"]);
        assert_eq!(
            models.iter().map(|m| m.adapter).collect::<Vec<_>>(),
            [false, true]
        );
        assert_eq!(max_model_len(&models), Some(2048));
        let card: serde_json::Value = serde_json::from_str(models[0].card.get()).expect("JSON");
        assert_eq!(
            card["permission"][0]["x"], 1,
            "the card as the worker wrote it"
        );
        for bad in [
            r#"{"error": "x"}"#,
            r#"{"data": {}}"#,
            "[1]",
            "not json",
            r#"{"data": []"#,
        ] {
            assert!(parse_list(bad.as_bytes()).is_err(), "{bad}");
        }
        assert_eq!(parse_list(br#"{"data": []}"#).map(|m| m.len()), Ok(0));
    }

    #[test]
    fn a_long_list_keeps_its_first_models_and_long_fields_are_cut() {
        let data: Vec<_> = (0..5_000).map(|i| json!({"id": format!("m{i}")})).collect();
        let body = json!({"data": data}).to_string();
        let models = parse_list(body.as_bytes()).expect("a list");
        assert_eq!(models.len(), MAX_MODELS);
        assert_eq!(models[MAX_MODELS - 1].id, format!("m{}", MAX_MODELS - 1));
        let pad = "x".repeat(MAX_CARD);
        let body = json!({"data": [{"id": "a".repeat(MAX_ID + 1)}, {"id": "m", "pad": pad}]});
        let models = parse_list(body.to_string().as_bytes()).expect("a list");
        assert_eq!(ids(&models), ["m"]);
        assert!(models[0].card.get().len() < 100, "{}", models[0].card.get());
    }

    #[test]
    fn the_union_is_a_list_of_cards_within_its_bound() {
        let cards = [
            bare_card("a", None, Some(4096)),
            bare_card("b", Some("a"), None),
        ];
        let (bytes, left_out) = union_answer(cards.iter().map(|c| c.as_ref()));
        let doc: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        assert_eq!(doc["object"], "list");
        assert_eq!(doc["data"][0]["max_model_len"], 4096);
        assert_eq!(doc["data"][1]["parent"], "a");
        assert_eq!(left_out, 0);
        let big = RawValue::from_string(format!("\"{}\"", "x".repeat(3 << 20))).expect("raw");
        let (bytes, left_out) = union_answer([big.as_ref(), big.as_ref()]);
        assert!(bytes.len() <= MAX_UNION_BYTES);
        assert_eq!(left_out, 1);
    }
}
