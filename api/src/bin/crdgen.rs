//! Writes a CRD as YAML to stdout: the InferenceService's, or with `inferencetenant` the
//! InferenceTenant's. `crds/` holds their output, and a test fails when a committed file is
//! stale.

fn main() -> anyhow::Result<()> {
    let yaml = match std::env::args().nth(1).as_deref() {
        None | Some("inferenceservice") => ferrite_api::crd::crd_yaml()?,
        Some("inferencetenant") => ferrite_api::tenant::crd_yaml()?,
        Some(other) => anyhow::bail!("no CRD named {other}: inferenceservice or inferencetenant"),
    };
    print!("{yaml}");
    Ok(())
}
