//! Named workloads with the engines' cache sizes they were measured at, so
//! a comparison with another router can be run again exactly:
//! `kvroute mocker --preset NAME` for the engines, `kvroute bench --preset
//! NAME` for the load.
//!
//! | preset | groups | prefix + suffix tokens | blocks of 16 per engine | requests | in flight | output tokens |
//! | --- | --- | --- | --- | --- | --- | --- |
//! | `long` | 32 | 2 048 + 64 | 2 048 | 1 000 | 16 | 16 |
//! | `short` | 32 | 256 + 32 | 256 | 1 000 | 16 | 16 |
//! | `pd` | 32 | 2 048 + 64 | 2 048 | 400 | 16 | 32 |
//!
//! The published comparison gives no output length; 16 tokens is what its
//! rates imply (16 in flight at 43 requests/s is 372 ms a request, ~60 ms
//! of it to the first token, the rest ~17 decode steps of ~18 ms).
//!
//! `pd` is `long` served by a disaggregated fleet, [`PdLayout::DEFAULT`]:
//! two prefill engines and two decode engines, with fewer requests (each
//! crosses two engines) and longer answers (decode is half the story).
//!
//! All are `shared-prefix`: each request is one group's prefix and a
//! suffix of its own. The engines' caches cannot hold every group's prefix
//! on every engine, so where requests go shows in the hit rate.

use kvroute_core::scheduler::WorkerRole;

use crate::error::Error;
use crate::workload::{WorkloadKind, WorkloadSpec};

/// The shape of a disaggregated fleet: prefill engines, then decode engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PdLayout {
    /// Engines with `role=prefill` (the first ones).
    pub prefill: u16,
    /// Engines with `role=decode` (the rest).
    pub decode: u16,
}

impl PdLayout {
    /// Two prefill engines and two decode engines: the `pd` preset's fleet.
    pub const DEFAULT: PdLayout = PdLayout {
        prefill: 2,
        decode: 2,
    };

    /// Engines in all.
    pub fn engines(self) -> u16 {
        self.prefill + self.decode
    }

    /// Each engine's role, prefill engines first.
    pub fn roles(self) -> Vec<WorkerRole> {
        let prefill = std::iter::repeat_n(WorkerRole::Prefill, usize::from(self.prefill));
        let decode = std::iter::repeat_n(WorkerRole::Decode, usize::from(self.decode));
        prefill.chain(decode).collect()
    }
}

impl std::str::FromStr for PdLayout {
    type Err = Error;

    /// `P:D`, e.g. `2:2`; each at least 1.
    fn from_str(s: &str) -> Result<Self, Error> {
        let invalid =
            || Error::Invalid(format!("`{s}`: expected PREFILL:DECODE engines, e.g. 2:2"));
        let (p, d) = s.split_once(':').ok_or_else(invalid)?;
        let prefill: u16 = p.trim().parse().map_err(|_| invalid())?;
        let decode: u16 = d.trim().parse().map_err(|_| invalid())?;
        if prefill == 0 || decode == 0 || prefill.checked_add(decode).is_none() {
            return Err(invalid());
        }
        Ok(PdLayout { prefill, decode })
    }
}

impl std::fmt::Display for PdLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.prefill, self.decode)
    }
}

/// A named workload and the engines it runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// 32 groups of 2 048-token prefixes with 64-token suffixes, 2 048
    /// blocks per engine.
    Long,
    /// 32 groups of 256-token prefixes with 32-token suffixes, 256 blocks
    /// per engine.
    Short,
    /// `Long`'s groups and caches on two prefill and two decode engines.
    Pd,
}

impl Preset {
    /// Every preset.
    pub const ALL: [Preset; 3] = [Preset::Long, Preset::Short, Preset::Pd];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Long => "long",
            Preset::Short => "short",
            Preset::Pd => "pd",
        }
    }

    /// The preset of that name.
    pub fn parse(name: &str) -> Option<Preset> {
        Preset::ALL.into_iter().find(|p| p.name() == name)
    }

    /// (prefix tokens, suffix tokens, KV blocks per engine).
    fn sizes(self) -> (usize, usize, usize) {
        match self {
            Preset::Long | Preset::Pd => (2_048, 64, 2_048),
            Preset::Short => (256, 32, 256),
        }
    }

    /// Prefix groups.
    pub fn groups(self) -> usize {
        32
    }

    /// Requests a run sends.
    pub fn requests(self) -> usize {
        match self {
            Preset::Pd => 400,
            Preset::Long | Preset::Short => 1_000,
        }
    }

    /// Requests in flight (closed loop).
    pub fn concurrency(self) -> usize {
        16
    }

    /// KV-cache blocks of 16 tokens per engine (`kvroute mocker --num-gpu-blocks`).
    pub fn gpu_blocks(self) -> usize {
        self.sizes().2
    }

    /// Tokens generated per request.
    pub fn max_tokens(self) -> u32 {
        match self {
            Preset::Pd => 32,
            Preset::Long | Preset::Short => 16,
        }
    }

    /// The disaggregated fleet the preset runs on; `None`: aggregated engines.
    pub fn layout(self) -> Option<PdLayout> {
        match self {
            Preset::Pd => Some(PdLayout::DEFAULT),
            Preset::Long | Preset::Short => None,
        }
    }

    /// The workload, with `seed`.
    pub fn workload(self, seed: u64) -> WorkloadSpec {
        let max_tokens = self.max_tokens();
        let (prefix, suffix, _) = self.sizes();
        WorkloadSpec {
            kind: WorkloadKind::SharedPrefix,
            seed,
            groups: self.groups(),
            max_tokens,
            prefix_tokens: Some(prefix),
            question_tokens: Some(suffix),
            ..WorkloadSpec::default()
        }
    }
}

impl std::fmt::Display for Preset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_published_sizes_and_their_names() {
        let long = Preset::Long.workload(3);
        assert_eq!(long.describe()["sizes"]["prefix_tokens"], 2_048);
        assert_eq!(long.describe()["sizes"]["question_tokens"], 64);
        assert_eq!(
            long.max_tokens, 16,
            "the published comparison's output length"
        );
        assert_eq!(
            (long.groups, long.seed, long.kind),
            (32, 3, WorkloadKind::SharedPrefix)
        );
        let short = Preset::Short.workload(1).describe();
        assert_eq!(short["sizes"]["prefix_tokens"], 256);
        assert_eq!(short["sizes"]["question_tokens"], 32);
        assert_eq!(
            (Preset::Long.gpu_blocks(), Preset::Short.gpu_blocks()),
            (2_048, 256)
        );
        for p in [Preset::Long, Preset::Short] {
            assert_eq!(Preset::parse(p.name()), Some(p));
            assert_eq!((p.requests(), p.concurrency()), (1_000, 16));
            assert_eq!(p.layout(), None);
        }
        let pd = Preset::Pd;
        assert_eq!(Preset::parse("pd"), Some(pd));
        assert_eq!(
            (pd.requests(), pd.max_tokens(), pd.gpu_blocks()),
            (400, 32, 2_048)
        );
        assert_eq!(
            pd.layout(),
            Some(PdLayout {
                prefill: 2,
                decode: 2
            })
        );
        assert_eq!(Preset::parse("medium"), None);
    }

    #[test]
    fn layouts_parse_as_prefill_colon_decode() {
        let layout: PdLayout = "1:3".parse().expect("valid");
        assert_eq!(
            layout,
            PdLayout {
                prefill: 1,
                decode: 3
            }
        );
        assert_eq!(layout.to_string(), "1:3");
        assert_eq!(
            layout.roles(),
            [
                WorkerRole::Prefill,
                WorkerRole::Decode,
                WorkerRole::Decode,
                WorkerRole::Decode
            ]
        );
        for bad in ["2", "0:2", "2:0", "a:b", "2:2:2", "65535:1"] {
            assert!(bad.parse::<PdLayout>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_preset_request_is_its_groups_prefix_and_a_suffix() {
        let workload = crate::workload::Workload::new(&Preset::Short.workload(1));
        let request = workload.try_next().expect("a request");
        let prompt = request.body["prompt"].as_array().map_or(0, Vec::len);
        assert_eq!(prompt, 256 + 32);
    }
}
