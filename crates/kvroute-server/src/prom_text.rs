//! Reading Prometheus' text exposition format, the one reader of it in the
//! tree: the router reads its engines' `/metrics` with it
//! (`router::reported`), and the load generator and the benchmarks read
//! kvroute's own. Lenient by design: a line that does not parse is skipped,
//! never an error, since the text comes from other programs.

/// One sample line: its metric name, its labels and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// The metric's name (with a counter's `_total`).
    pub name: &'a str,
    /// Its labels, in the order written, values unquoted (escapes are not
    /// undone: the labels read here are names and numbers).
    pub labels: Vec<(&'a str, &'a str)>,
    /// Its value.
    pub value: f64,
}

impl<'a> Sample<'a> {
    /// The value of the label `key`, when the sample has it.
    pub fn label(&self, key: &str) -> Option<&'a str> {
        self.labels.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    }
}

/// One line of the text; `None` for comments, blanks and lines that do not
/// parse.
pub fn sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (head, rest) = match line.find('{') {
        Some(open) => {
            let close = open + line[open..].find('}')?;
            (&line[..close + 1], &line[close + 1..])
        }
        None => line.split_at(line.find(char::is_whitespace)?),
    };
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    let (name, labels) = match head.split_once('{') {
        None => (head, Vec::new()),
        Some((name, body)) => {
            let body = body.strip_suffix('}')?;
            let labels = body
                .split(',')
                .filter(|kv| !kv.trim().is_empty())
                .filter_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    Some((k.trim(), v.trim().trim_matches('"')))
                })
                .collect();
            (name, labels)
        }
    };
    Some(Sample {
        name: name.trim(),
        labels,
        value,
    })
}

/// Every sample of `text`, in order.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(sample)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_with_and_without_labels_are_read_and_the_rest_skipped() {
        let text = "# HELP x y\n\
                    a_total 3\n\
                    b{worker=\"w0\",dp_rank=\"1\"} 2.5 1700000000\n\
                    not a sample\n\
                    c{broken 1\n";
        let all: Vec<Sample<'_>> = samples(text).collect();
        assert_eq!(all.len(), 2, "{all:?}");
        assert_eq!((all[0].name, all[0].value), ("a_total", 3.0));
        assert_eq!(all[1].label("worker"), Some("w0"));
        assert_eq!(all[1].label("dp_rank"), Some("1"));
        assert_eq!(all[1].value, 2.5);
        assert_eq!(all[1].label("nope"), None);
    }
}
