//! Fuzz target: any bytes as `serve --endpoints-file`'s file
//! (`kvroute_server::discovery::endpoints::parse_endpoints`, on the text the
//! watcher hands it: the bytes as UTF-8, lossily here so that every input
//! reaches the YAML reader).
//!
//! Besides not panicking, each parse must stay within the bounds the
//! endpoints file promises (docs/serving.md, "An endpoints file"):
//!
//! * the YAML reader (`discovery::bounded_yaml`) never builds more than its
//!   node and text bounds, aliases counted expanded, and its peak live
//!   allocation (counted by this target's global allocator) stays under
//!   [`PEAK_BYTES`] for any input of at most 1 MiB, whatever its aliases say;
//! * a file it accepts lists at most 4 096 workers, each under its own name,
//!   and an accepted file with no workers says `endpoints: []` explicitly
//!   (anything that lists nothing is refused, so a truncated file never
//!   removes every worker);
//! * the parse is deterministic (a second parse gives the same result).
//!
//! Time is bounded by libFuzzer's `-timeout` (docs/fuzzing.md runs it with 10 s).
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use kvroute_server::discovery::bounded_yaml::{self, MAX_NODES, MAX_TEXT_BYTES};
use kvroute_server::discovery::endpoints::{
    parse_endpoints, EndpointDefaults, MAX_ENDPOINTS, MAX_FILE_BYTES,
};
use libfuzzer_sys::fuzz_target;

/// The most a parse may hold at once: measured dearest inputs cost 66 MB (a
/// plain 1 MiB file of short map entries) and 38 MB (aliases up to the node
/// bound); twice the larger leaves room for allocator rounding, never for
/// an expansion that grows with what the aliases ask.
const PEAK_BYTES: usize = 128 << 20;

/// Live and peak bytes the program has allocated.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
            PEAK.fetch_max(live, Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        System.dealloc(p, layout);
        LIVE.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = System.realloc(p, layout, new_size);
        if !q.is_null() {
            if new_size >= layout.size() {
                let grown = new_size - layout.size();
                let live = LIVE.fetch_add(grown, Relaxed) + grown;
                PEAK.fetch_max(live, Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns its result with the most it allocated beyond what
/// was live before.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let out = f();
    (out, PEAK.load(Relaxed).saturating_sub(base))
}

fuzz_target!(|data: &[u8]| {
    if data.len() > MAX_FILE_BYTES {
        return;
    }
    let text = String::from_utf8_lossy(data);
    let (loaded, peak) = peak_of(|| bounded_yaml::load_with_cost(&text));
    assert!(peak <= PEAK_BYTES, "the YAML reader held {peak} bytes");
    if let Ok((_, cost)) = &loaded {
        assert!(
            cost.nodes <= MAX_NODES && cost.text_bytes <= MAX_TEXT_BYTES,
            "{cost:?}"
        );
    }
    drop(loaded);

    let defaults = EndpointDefaults::default();
    let (parsed, peak) = peak_of(|| parse_endpoints(&text, &defaults, Some(16)));
    assert!(peak <= PEAK_BYTES, "parse_endpoints held {peak} bytes");
    match &parsed {
        Ok(specs) => {
            assert!(specs.len() <= MAX_ENDPOINTS);
            for (name, spec) in specs {
                assert_eq!(name, &spec.name);
            }
            if specs.is_empty() {
                assert!(
                    text.contains('['),
                    "no workers without an explicit `endpoints: []`"
                );
            }
        }
        Err(e) => assert!(!e.0.is_empty(), "a refusal names its problem"),
    }
    assert_eq!(
        parsed,
        parse_endpoints(&text, &defaults, Some(16)),
        "deterministic"
    );
});
