//! The flag parsers more than one command shares, in one place: a preset's
//! name, a prefill/decode layout, a workload's name, a header name.

use kvroute_loadgen as load;
use kvroute_loadgen::PdLayout;

/// `--pd`'s value (`P:D`).
pub fn parse_layout(s: &str) -> Result<PdLayout, String> {
    s.parse().map_err(|e: load::Error| e.to_string())
}

/// `--workload`: the load generator's names, listed in `--help`.
pub fn workload_parser() -> impl clap::builder::TypedValueParser<Value = load::WorkloadKind> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(load::WorkloadKind::ALL.map(load::WorkloadKind::name))
        .try_map(|s| s.parse::<load::WorkloadKind>())
}

/// `--preset`'s value.
pub fn parse_preset(name: &str) -> Result<load::Preset, String> {
    load::Preset::parse(name).ok_or_else(|| {
        let names: Vec<&str> = load::Preset::ALL.iter().map(|p| p.name()).collect();
        format!("unknown preset `{name}` (known: {})", names.join(", "))
    })
}

/// `--session-header`'s and `--tenant-header`'s value: a valid header
/// name, in lower case.
pub fn parse_header_name(value: &str) -> Result<String, String> {
    let valid = !value.is_empty()
        && value.len() <= 64
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if valid {
        Ok(value.to_ascii_lowercase())
    } else {
        Err(format!(
            "`{value}` is not a header name (letters, digits, - and _)"
        ))
    }
}
