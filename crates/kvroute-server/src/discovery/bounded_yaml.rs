//! YAML read with bounds on what it may build: the endpoints file's loader.
//!
//! yaml-rust2's own loader (`YamlLoader`) expands every alias by cloning the
//! node its anchor names, with no limit, so a file of a few hundred bytes
//! whose anchors each repeat the one before nine times (a "billion laughs")
//! builds billions of nodes before any check on the result can run. This
//! loader drives yaml-rust2's event [`Parser`] itself and builds the same
//! [`Yaml`] tree, but charges every node it builds (an alias: the whole
//! expanded size of its anchor's node, and an anchored node once more for
//! the copy an alias is cloned from) against [`MAX_NODES`] and
//! [`MAX_TEXT_BYTES`], and refuses nesting deeper than [`MAX_DEPTH`], *before*
//! building it. Work and memory are therefore bounded by those figures
//! whatever the text says; an honest endpoints file stays far below them.
//! Pure: text in, the first document (or the first problem) out.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::TScalarStyle;
use yaml_rust2::yaml::Hash;
use yaml_rust2::Yaml;

/// The most nodes (scalars, lists, maps; an alias at its expanded size)
/// one text may build: 2^18 = 262 144. An honest file is far below it:
/// 4 096 endpoints of five fields and eight labels build 110 595 nodes (and
/// take 1.5 MB, more than the file may), and a 1 MiB file crosses it only by
/// averaging under four bytes a node, which no list of endpoints does.
/// Built, that many nodes cost about 40 MB at most (measured: 38 MB for
/// 262 144 nodes as aliases of a one-pair map, the dearest alias shape); a
/// plain 1 MiB file of short map entries already costs more (66 MB for
/// 174 000 nodes).
pub const MAX_NODES: usize = 1 << 18;

/// The most bytes of scalar text one text may build (aliases at their
/// expanded size): 4 MiB, four times the largest file, room for labels an
/// anchor shares among many endpoints.
pub const MAX_TEXT_BYTES: usize = 4 << 20;

/// The deepest nesting of lists and maps one text may have: an endpoints
/// file needs five levels (the document, `endpoints`, an entry, its
/// `labels`, a value); 64 leaves room for any honest layout, and keeps
/// building, cloning and dropping the tree (all recursive) off deep stacks.
pub const MAX_DEPTH: usize = 64;

/// Why a text was not read: not YAML, or over a bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct YamlError(pub String);

/// What building a node costs: the nodes it holds and their scalar text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cost {
    /// Scalars, lists and maps (an alias counts its whole node).
    pub nodes: usize,
    /// Bytes of scalar text.
    pub text_bytes: usize,
}

impl Cost {
    fn add(&mut self, other: Cost) {
        self.nodes += other.nodes;
        self.text_bytes += other.text_bytes;
    }
}

/// A list or map being built, and what it holds so far.
struct Open {
    node: Yaml,
    anchor: usize,
    /// A map's key waiting for its value.
    key: Option<Yaml>,
    cost: Cost,
}

/// The tree being built, its anchors and what it has cost.
#[derive(Default)]
struct Builder {
    open: Vec<Open>,
    /// Each finished anchored node by anchor id, with its cost.
    anchors: HashMap<usize, (Yaml, Cost)>,
    /// The first document's root, once finished.
    first: Option<Yaml>,
    /// Every node built so far, the anchors' copies included.
    spent: Cost,
}

/// The first document of `text` (`None` when it has none: empty, blank or
/// only comments), built within [`MAX_NODES`], [`MAX_TEXT_BYTES`] and
/// [`MAX_DEPTH`]; later documents are checked and charged, then dropped.
/// Plain scalars are typed as yaml-rust2's loader types them (integers,
/// reals, booleans, null); quoted or tagged ones stay strings.
pub fn load_first(text: &str) -> Result<Option<Yaml>, YamlError> {
    load_with_cost(text).map(|(doc, _)| doc)
}

/// [`load_first`], and what the text cost to build (never over the bounds).
pub fn load_with_cost(text: &str) -> Result<(Option<Yaml>, Cost), YamlError> {
    let mut parser = Parser::new_from_str(text);
    let mut builder = Builder::default();
    loop {
        let (event, _) = parser
            .next_token()
            .map_err(|e| YamlError(format!("not YAML: {e}")))?;
        match event {
            Event::StreamEnd => break,
            Event::Nothing | Event::StreamStart | Event::DocumentStart | Event::DocumentEnd => {}
            Event::SequenceStart(anchor, _) => builder.open(Yaml::Array(Vec::new()), anchor)?,
            Event::MappingStart(anchor, _) => builder.open(Yaml::Hash(Hash::new()), anchor)?,
            Event::SequenceEnd | Event::MappingEnd => builder.close()?,
            Event::Scalar(value, style, anchor, tag) => {
                let cost = Cost {
                    nodes: 1,
                    text_bytes: value.len(),
                };
                builder.charge(cost)?;
                let node = if style == TScalarStyle::Plain && tag.is_none() {
                    Yaml::from_str(&value)
                } else {
                    Yaml::String(value)
                };
                builder.finish(node, anchor, cost)?;
            }
            Event::Alias(id) => {
                let (node, cost) = builder
                    .anchors
                    .get(&id)
                    .ok_or_else(|| YamlError("an alias names a node that contains it".into()))?;
                let (node, cost) = (node.clone(), *cost);
                // Charged before the clone below is made: `charge` refuses first.
                builder.charge(cost)?;
                builder.finish(node, 0, cost)?;
            }
        }
    }
    Ok((builder.first, builder.spent))
}

impl Builder {
    /// Adds `cost` to what was spent, or refuses when that crosses a bound.
    fn charge(&mut self, cost: Cost) -> Result<(), YamlError> {
        let mut spent = self.spent;
        spent.add(cost);
        if spent.nodes > MAX_NODES {
            return Err(YamlError(format!(
                "more than {MAX_NODES} nodes (an alias counts as the node it repeats)"
            )));
        }
        if spent.text_bytes > MAX_TEXT_BYTES {
            return Err(YamlError(format!(
                "more than {MAX_TEXT_BYTES} bytes of text (an alias counts as the node it repeats)"
            )));
        }
        self.spent = spent;
        Ok(())
    }

    /// Starts a list or map.
    fn open(&mut self, node: Yaml, anchor: usize) -> Result<(), YamlError> {
        if self.open.len() >= MAX_DEPTH {
            return Err(YamlError(format!(
                "lists and maps nested deeper than {MAX_DEPTH}"
            )));
        }
        let cost = Cost {
            nodes: 1,
            text_bytes: 0,
        };
        self.charge(cost)?;
        self.open.push(Open {
            node,
            anchor,
            key: None,
            cost,
        });
        Ok(())
    }

    /// Ends the innermost list or map.
    fn close(&mut self) -> Result<(), YamlError> {
        let open = self
            .open
            .pop()
            .ok_or_else(|| YamlError("an end with nothing open".into()))?;
        if open.key.is_some() {
            return Err(YamlError("a map key without a value".into()));
        }
        self.finish(open.node, open.anchor, open.cost)
    }

    /// Places a finished node (of `cost`) in the list or map it belongs to,
    /// or as a document's root; keeps a copy under its anchor, if any.
    fn finish(&mut self, node: Yaml, anchor: usize, cost: Cost) -> Result<(), YamlError> {
        if anchor > 0 {
            // The copy aliases clone from is built too.
            self.charge(cost)?;
            self.anchors.insert(anchor, (node.clone(), cost));
        }
        let Some(parent) = self.open.last_mut() else {
            if self.first.is_none() {
                self.first = Some(node);
            }
            return Ok(());
        };
        parent.cost.add(cost);
        match &mut parent.node {
            Yaml::Array(list) => list.push(node),
            Yaml::Hash(map) => match parent.key.take() {
                None => parent.key = Some(node),
                Some(key) => {
                    if map.contains_key(&key) {
                        return Err(YamlError(format!("{key:?}: duplicated key in mapping")));
                    }
                    map.insert(key, node);
                }
            },
            _ => return Err(YamlError("a node inside a scalar".into())),
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A bomb: anchor `a0`, a list of nine scalars, then `levels` anchors,
    /// each a list of nine aliases of the one before, so 9^(levels + 1)
    /// scalars once expanded (the probe's critical file is `bomb(11)`, 9^12;
    /// its smaller one, accepted at 200 MB before, 9^6: `bomb(5)`).
    pub(crate) fn bomb(levels: usize) -> String {
        let mut lines =
            vec![r#"a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]"#.to_owned()];
        for i in 1..=levels {
            let refs = vec![format!("*a{}", i - 1); 9].join(",");
            lines.push(format!("a{i}: &a{i} [{refs}]"));
        }
        lines.join("\n")
            + &format!(
                "\nendpoints:\n  - name: e0\n    address: 127.0.0.1\n    port: \"47700\"\n    labels: {{x: *a{levels}}}\n"
            )
    }

    #[test]
    fn documents_read_as_yaml_rust2_reads_them() {
        let text = "a: 1\nb: [x, 'y', 2.5, true, ~]\nc: &c {k: v}\nd: *c\n---\nsecond: doc\n";
        let (doc, cost) = load_with_cost(text).expect("valid");
        let theirs = yaml_rust2::YamlLoader::load_from_str(text).expect("valid");
        assert_eq!(doc.as_ref(), theirs.first());
        // a 1 b [5] c {k v} (twice: the anchor's copy) d {k v}, and the second document.
        assert!(cost.nodes > 20 && cost.nodes < 40, "{cost:?}");
        for blank in ["", "\n\n", "# only a comment\n", "   "] {
            assert_eq!(load_first(blank).expect("blank"), None, "{blank:?}");
        }
        assert_eq!(load_first("---\n").expect("empty doc"), Some(Yaml::Null));
    }

    #[test]
    fn alias_bombs_are_refused_before_they_are_built() {
        for levels in [5, 11, 40] {
            let text = bomb(levels);
            let e = load_first(&text).expect_err("a bomb");
            assert!(e.0.contains("nodes (an alias counts"), "{e}");
        }
        // 9^4 = 6 561 scalars fit: bounded, and read.
        let (_, cost) = load_with_cost(&bomb(3)).expect("within the bounds");
        // a3 holds 7 381 nodes: built once, copied for its anchor, cloned by the alias.
        assert!(
            cost.nodes >= 3 * 7_381 && cost.nodes < MAX_NODES,
            "{cost:?}"
        );
    }

    #[test]
    fn long_text_repeated_by_aliases_is_refused() {
        let long = "x".repeat(64 << 10);
        let refs = vec!["*t"; 100].join(",");
        let text = format!("t: &t \"{long}\"\nl: [{refs}]\n");
        let e = load_first(&text).expect_err("6.4 MB of text");
        assert!(e.0.contains("bytes of text"), "{e}");
    }

    #[test]
    fn deep_nesting_and_bad_aliases_are_refused() {
        // Flow nesting: yaml-rust2's scanner stops at 255 levels, we at 64.
        let flow = "[".repeat(100) + &"]".repeat(100);
        let e = load_first(&flow).expect_err("100 flow levels");
        assert!(e.0.contains("nested deeper"), "{e}");
        // Block nesting has no limit in the scanner: ours is the one.
        let block: String = "- ".repeat(100_000) + "x\n";
        let e = load_first(&block).expect_err("100 000 block levels");
        assert!(e.0.contains("nested deeper"), "{e}");
        let fits: String = "- ".repeat(MAX_DEPTH) + "x\n";
        assert!(load_first(&fits).is_ok());
        let e = load_first("a: &a [1, *a]\n").expect_err("self");
        assert!(
            e.0.contains("contains it") || e.0.contains("not YAML"),
            "{e}"
        );
        let e = load_first("a: *nowhere\n").expect_err("unknown");
        assert!(e.0.contains("not YAML"), "{e}");
        let e = load_first("a: 1\na: 2\n").expect_err("duplicate");
        assert!(e.0.contains("duplicated key"), "{e}");
    }
}
