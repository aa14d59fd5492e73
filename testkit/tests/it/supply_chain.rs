//! What `cargo deny` checks for licenses, bans and sources, on the graph cargo resolves from
//! `Cargo.lock` (every target, every feature): cargo-deny itself would have to be compiled
//! from crates.io on every cold CI run, and its advisory check needs the RustSec database,
//! which is not reachable from here (docs/ci.md).
//! - sources: every package is the workspace's own or comes from crates.io (no git, no other
//!   registry, no path outside the workspace);
//! - licenses: each package's SPDX expression is satisfiable with the permissive licenses
//!   below (an `OR` needs one allowed branch, an `AND` all);
//! - bans: nothing links OpenSSL (`openssl`, `openssl-sys`, `native-tls`): TLS is rustls
//!   everywhere, so the binaries need no system library and one TLS stack is audited.

use std::collections::BTreeSet;

use super::layering::metadata;

const CRATES_IO: &str = "registry+https://github.com/rust-lang/crates.io-index";

/// Licenses that ask for attribution at most (MPL-2.0: per-file copyleft on the crate's own
/// files, which we do not modify).
const ALLOWED: [&str; 16] = [
    "MIT",
    "MIT-0",
    "Apache-2.0",
    "Apache-2.0 WITH LLVM-exception",
    "BSD-2-Clause",
    "BSD-3-Clause",
    "ISC",
    "Zlib",
    "0BSD",
    "Unlicense",
    "CC0-1.0",
    "BSL-1.0",
    "Unicode-3.0",
    "Unicode-DFS-2016",
    "CDLA-Permissive-2.0",
    "MPL-2.0",
];

const BANNED: [&str; 3] = ["openssl", "openssl-sys", "native-tls"];

/// Whether an SPDX license expression can be met with [`ALLOWED`] licenses. Legacy `/` reads
/// as `OR`; `WITH` binds an exception to the license before it.
fn allowed(expression: &str) -> Result<bool, String> {
    let spaced = expression
        .replace('(', " ( ")
        .replace(')', " ) ")
        .replace('/', " OR ");
    let tokens: Vec<&str> = spaced.split_whitespace().collect();
    let mut at = 0;
    let value = or(&tokens, &mut at)?;
    if at != tokens.len() {
        return Err(format!("{expression:?}: unexpected {:?}", tokens[at]));
    }
    Ok(value)
}

fn or(t: &[&str], at: &mut usize) -> Result<bool, String> {
    let mut v = and(t, at)?;
    while t.get(*at) == Some(&"OR") {
        *at += 1;
        v |= and(t, at)?;
    }
    Ok(v)
}

fn and(t: &[&str], at: &mut usize) -> Result<bool, String> {
    let mut v = term(t, at)?;
    while t.get(*at) == Some(&"AND") {
        *at += 1;
        v &= term(t, at)?;
    }
    Ok(v)
}

fn term(t: &[&str], at: &mut usize) -> Result<bool, String> {
    let first = *t.get(*at).ok_or("expression ends early")?;
    *at += 1;
    if first == "(" {
        let v = or(t, at)?;
        if t.get(*at) != Some(&")") {
            return Err("unbalanced parenthesis".into());
        }
        *at += 1;
        return Ok(v);
    }
    if ["AND", "OR", "WITH", ")"].contains(&first) {
        return Err(format!("{first} where a license belongs"));
    }
    let license = if t.get(*at) == Some(&"WITH") {
        let exception = t.get(*at + 1).ok_or("WITH without an exception")?;
        *at += 2;
        format!("{first} WITH {exception}")
    } else {
        first.to_string()
    };
    Ok(ALLOWED.contains(&license.as_str()))
}

#[test]
fn every_dependency_is_from_crates_io_permissively_licensed_and_free_of_openssl() {
    let m = metadata();
    let members: BTreeSet<&str> = m["workspace_members"]
        .as_array()
        .expect("members")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    let mut problems = Vec::new();
    let mut checked = 0;
    for p in m["packages"].as_array().expect("packages") {
        let id = p["id"].as_str().unwrap_or_default();
        let name = format!(
            "{} {}",
            p["name"].as_str().unwrap_or_default(),
            p["version"].as_str().unwrap_or_default()
        );
        if members.contains(id) {
            continue;
        }
        checked += 1;
        if p["source"].as_str() != Some(CRATES_IO) {
            problems.push(format!("{name}: from {}, not crates.io", p["source"]));
        }
        match p["license"].as_str() {
            None => problems.push(format!("{name}: no SPDX license expression")),
            Some(l) => match allowed(l) {
                Ok(true) => {}
                Ok(false) => problems.push(format!("{name}: license {l:?} is not allowed")),
                Err(e) => problems.push(format!("{name}: license {e}")),
            },
        }
        if BANNED.contains(&p["name"].as_str().unwrap_or_default()) {
            problems.push(format!("{name}: banned (TLS is rustls)"));
        }
    }
    assert!(checked > 100, "only {checked} dependencies resolved");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    println!("{checked} dependencies: crates.io, permissive licenses, no OpenSSL");
}

/// The license check refuses what it should, so passing means something.
#[test]
fn the_license_check_reads_spdx_expressions() {
    assert_eq!(allowed("MIT OR Apache-2.0"), Ok(true));
    assert_eq!(allowed("MIT/Apache-2.0"), Ok(true));
    assert_eq!(allowed("(MIT OR Apache-2.0) AND Unicode-3.0"), Ok(true));
    assert_eq!(
        allowed("Apache-2.0 WITH LLVM-exception OR GPL-3.0"),
        Ok(true)
    );
    assert_eq!(allowed("GPL-3.0-only"), Ok(false));
    assert_eq!(allowed("MIT AND GPL-3.0-only"), Ok(false));
    assert_eq!(allowed("MIT OR Apache-2.0 OR LGPL-2.1-or-later"), Ok(true));
    assert_eq!(
        allowed("LGPL-2.1-or-later AND (MIT OR Apache-2.0)"),
        Ok(false)
    );
    assert_eq!(allowed("GPL-2.0 WITH Classpath-exception-2.0"), Ok(false));
    assert!(allowed("(MIT").is_err());
    assert!(allowed("MIT AND").is_err());
    assert!(allowed("MIT Apache-2.0").is_err());
}
