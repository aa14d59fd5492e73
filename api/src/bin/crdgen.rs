//! Writes the InferenceService CRD as YAML to stdout; `crds/` holds its output, and a test fails
//! when the committed file is stale.

fn main() -> anyhow::Result<()> {
    print!("{}", ferrite_api::crd::crd_yaml()?);
    Ok(())
}
