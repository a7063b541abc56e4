//! `kvroute serve`'s tenant flags: which header names a request's tenant
//! and what each tenant weighs in the overload queue's fair order
//! (`kvroute_server::proxy::tenants`).

use clap::Args;
use kvroute_core::scheduler::fair::WEIGHT_RANGE;
use kvroute_server::proxy::tenants::TenantConfig;

/// The tenant flags of `kvroute serve`.
#[derive(Debug, Args)]
pub struct TenancyArgs {
    /// The header naming a request's tenant; without it, the tenant is the
    /// fingerprint of the request's API key (`Authorization: Bearer`;
    /// `key-` and 12 hex digits of its SHA-256), else `anonymous`. While
    /// the queue is used, tenants share the fleet in proportion to their
    /// weights, and a full queue refuses the tenant most over its share
    /// (docs/serving.md)
    #[arg(long, default_value_t = TenantConfig::default().header, env = "KVROUTE_TENANT_HEADER", value_parser = super::serve::parse_header_name)]
    tenant_header: String,
    /// A tenant's weight in the queue's fair order, NAME=W (W > 0; repeat
    /// for each tenant, or comma-separate them in the environment);
    /// unnamed tenants weigh 1. The tenants named here are also the ones
    /// metrics name (every other one is `other`)
    #[arg(long = "tenant-weight", value_name = "NAME=W", value_parser = parse_tenant_weight, value_delimiter = ',', env = "KVROUTE_TENANT_WEIGHTS")]
    tenant_weights: Vec<(String, f64)>,
}

impl TenancyArgs {
    /// The proxy's tenant settings.
    pub fn config(&self) -> TenantConfig {
        TenantConfig {
            header: self.tenant_header.clone(),
            weights: self.tenant_weights.clone(),
        }
    }
}

/// `NAME=W`: a tenant name as the header or `key-…` names it, and a
/// weight in `kvroute_core`'s [`WEIGHT_RANGE`].
fn parse_tenant_weight(value: &str) -> Result<(String, f64), String> {
    let (name, weight) = value
        .split_once('=')
        .ok_or_else(|| format!("`{value}`: expected NAME=W"))?;
    let name = name.trim();
    if name.is_empty() || name.len() > 128 || !name.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "`{name}`: a tenant is 1 to 128 printable ASCII characters"
        ));
    }
    let (min, max) = WEIGHT_RANGE;
    match weight.trim().parse::<f64>() {
        Ok(w) if (min..=max).contains(&w) => Ok((name.to_owned(), w)),
        _ => Err(format!(
            "`{weight}`: a weight is a number from {min} to {max}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_weight_is_a_name_and_a_positive_number() {
        assert_eq!(parse_tenant_weight("gold=4"), Ok(("gold".to_owned(), 4.0)));
        assert_eq!(
            parse_tenant_weight("key-f3abf2a6cc4f=0.5"),
            Ok(("key-f3abf2a6cc4f".to_owned(), 0.5))
        );
        for bad in [
            "gold", "=2", "gold=0", "gold=-1", "gold=x", "a b=1", "gold=NaN",
        ] {
            assert!(parse_tenant_weight(bad).is_err(), "{bad}");
        }
    }
}
