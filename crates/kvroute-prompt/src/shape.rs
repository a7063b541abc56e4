//! A body's shape, read without building it: how many JSON values it holds
//! and how many parts its prompt has, so that a router can tell what
//! parsing and rendering a large body will cost, and refuse a prompt that
//! cannot fit any context, before it spends that.
//!
//! One pass of serde's parser over the bytes, keeping counts only: no value
//! is built and nothing is allocated by a size the body chose. A body that
//! is not valid JSON has no shape (its parse answers the client).

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// What a body holds, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BodyShape {
    /// JSON values of every kind, at every depth (the body itself included).
    pub values: usize,
    /// Items of the top-level `messages` (chat, Messages) and `input`
    /// (Responses) lists: each renders to at least one token of the prompt.
    pub prompt_parts: usize,
}

/// The shape of `body`, if it is one valid JSON document.
pub fn shape(body: &[u8]) -> Option<BodyShape> {
    let mut shape = BodyShape::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    Count {
        shape: &mut shape,
        top: true,
        parts: false,
    }
    .deserialize(&mut de)
    .ok()?;
    de.end().ok()?;
    Some(shape)
}

/// Counts one value into `shape`: `top` for the body itself, `parts` for
/// the value of a prompt-part list's key.
struct Count<'s> {
    shape: &'s mut BodyShape,
    top: bool,
    parts: bool,
}

impl<'de> DeserializeSeed<'de> for Count<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        self.shape.values += 1;
        deserializer.deserialize_any(self)
    }
}

/// The key of a top-level field, told apart only as "a prompt-part list or
/// not", without keeping it.
struct PartsKey;

impl<'de> DeserializeSeed<'de> for PartsKey {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl Visitor<'_> for PartsKey {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
        Ok(key == "messages" || key == "input")
    }
}

impl<'de> Visitor<'de> for Count<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut items = 0usize;
        while seq
            .next_element_seed(Count {
                shape: &mut *self.shape,
                top: false,
                parts: false,
            })?
            .is_some()
        {
            items += 1;
        }
        if self.parts {
            self.shape.prompt_parts += items;
        }
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        loop {
            let parts = if self.top {
                match map.next_key_seed(PartsKey)? {
                    Some(parts) => parts,
                    None => return Ok(()),
                }
            } else {
                match map.next_key::<de::IgnoredAny>()? {
                    Some(_) => false,
                    None => return Ok(()),
                }
            };
            map.next_value_seed(Count {
                shape: &mut *self.shape,
                top: false,
                parts,
            })?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_and_prompt_parts_are_counted_without_building_the_body() {
        let body = br#"{"model": "m", "messages": [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}], "n": 1}"#;
        // The object, model, messages' list, 2 messages with 2 values each,
        // the second's part list with one part of two values, n.
        assert_eq!(
            shape(body),
            Some(BodyShape {
                values: 1 + 1 + 1 + 2 + 2 + 2 + 1 + 1 + 2,
                prompt_parts: 2
            })
        );
        let responses = br#"{"input": [{"role": "user", "content": "a"}, {"type": "function_call_output", "output": "b"}]}"#;
        assert_eq!(shape(responses).map(|s| s.prompt_parts), Some(2));
        // Only the body's own `messages` and `input` count as parts.
        let nested = br#"{"metadata": {"messages": [1, 2, 3]}, "input": "text"}"#;
        assert_eq!(shape(nested).map(|s| s.prompt_parts), Some(0));
        assert_eq!(
            shape(b"[1, 2]").map(|s| (s.values, s.prompt_parts)),
            Some((3, 0))
        );
    }

    #[test]
    fn only_one_valid_document_has_a_shape() {
        for bad in [&b"{"[..], b"{} {}", b"", b"{\"a\": }", b"nul"] {
            assert_eq!(shape(bad), None, "{}", String::from_utf8_lossy(bad));
        }
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(
            shape(deep.as_bytes()),
            None,
            "past serde_json's depth limit"
        );
    }
}
