//! X.509 versions and subject names, read from the DER directly. rustls, and so the
//! operator's Kubernetes client and the External Metrics API's TLS, accepts only v3
//! certificates, and `openssl x509 -req` without an extension file makes v1 ones. Checking at
//! start-up turns an obscure handshake error (`invalid private key ... UnsupportedCertVersion`)
//! into a message naming the certificate and the cause. The subject's common name is what the
//! External Metrics API checks against the allowed names of the aggregator's certificate.

use std::path::Path;

use base64::Engine as _;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject as _;

/// How to fix a v1 certificate, appended to every error about one.
const REISSUE: &str = "rustls accepts only X.509 v3 certificates; reissue it with extensions, e.g. \
`openssl x509 -req ... -extfile <(printf 'extendedKeyUsage=clientAuth')` (serverAuth for a \
serving certificate)";

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{what} is an X.509 v1 certificate: {REISSUE}")]
    V1 { what: String },
    #[error("{what}: {reason}")]
    Unreadable { what: String, reason: String },
}

/// Reads one DER length at `at`; returns (length, offset of the content).
fn der_length(der: &[u8], at: usize) -> Option<(usize, usize)> {
    let first = *der.get(at)?;
    if first < 0x80 {
        return Some((usize::from(first), at + 1));
    }
    let n = usize::from(first & 0x7f);
    if n == 0 || n > 4 {
        return None;
    }
    let mut len = 0usize;
    for i in 0..n {
        len = (len << 8) | usize::from(*der.get(at + 1 + i)?);
    }
    Some((len, at + 1 + n))
}

/// One DER element at `at`: (tag, content start, content end), the end within `der`.
fn tlv(der: &[u8], at: usize) -> Option<(u8, usize, usize)> {
    let tag = *der.get(at)?;
    let (len, start) = der_length(der, at + 1)?;
    let end = start.checked_add(len).filter(|&e| e <= der.len())?;
    Some((tag, start, end))
}

/// The elements inside `start..end`, in order.
fn children(der: &[u8], start: usize, end: usize) -> impl Iterator<Item = (u8, usize, usize)> + '_ {
    let mut at = start;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let e = tlv(der, at).filter(|e| e.2 <= end)?;
        at = e.2;
        Some(e)
    })
}

/// The subject's common name (the first CN) of a DER certificate, which Kubernetes reads as
/// the user of a client certificate. Only text string types; anything else is `None`.
pub fn subject_common_name(der: &[u8]) -> Option<String> {
    const CN: [u8; 3] = [0x55, 0x04, 0x03];
    let (0x30, cert, _) = tlv(der, 0)? else {
        return None;
    };
    let (0x30, tbs, tbs_end) = tlv(der, cert)? else {
        return None;
    };
    // [0] version?, serialNumber, signature, issuer, validity, subject.
    let fields: Vec<_> = children(der, tbs, tbs_end)
        .skip_while(|e| e.0 == 0xa0)
        .take(5)
        .collect();
    let &(0x30, subject, subject_end) = fields.get(4)? else {
        return None;
    };
    for (_, rdn, rdn_end) in children(der, subject, subject_end) {
        for (_, atv, atv_end) in children(der, rdn, rdn_end) {
            let mut parts = children(der, atv, atv_end);
            let (0x06, oid, oid_end) = parts.next()? else {
                continue;
            };
            if der.get(oid..oid_end)? != CN {
                continue;
            }
            // UTF8String, PrintableString, IA5String.
            let (0x0c | 0x13 | 0x16, value, value_end) = parts.next()? else {
                return None;
            };
            return String::from_utf8(der.get(value..value_end)?.to_vec()).ok();
        }
    }
    None
}

/// The X.509 version (1, 2 or 3) of a DER certificate: the optional `[0] EXPLICIT` version at
/// the start of tbsCertificate, absent in v1.
pub fn x509_version(der: &[u8]) -> Option<u8> {
    // Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL, ... } ... }
    if *der.first()? != 0x30 {
        return None;
    }
    let (_, tbs) = der_length(der, 1)?;
    if *der.get(tbs)? != 0x30 {
        return None;
    }
    let (_, first) = der_length(der, tbs + 1)?;
    if *der.get(first)? != 0xa0 {
        return Some(1);
    }
    // [0] { INTEGER version }: v2 is 1, v3 is 2.
    let (_, int) = der_length(der, first + 1)?;
    if *der.get(int)? != 0x02 {
        return None;
    }
    let (len, value) = der_length(der, int + 1)?;
    let v = *der.get(value + len.checked_sub(1)?)?;
    v.checked_add(1)
}

/// Fails when any certificate in a PEM bundle is X.509 v1.
pub fn check_pem(pem: &[u8], what: &str) -> Result<(), CertError> {
    for (i, cert) in CertificateDer::pem_slice_iter(pem).enumerate() {
        let cert = cert.map_err(|e| CertError::Unreadable {
            what: what.to_string(),
            reason: e.to_string(),
        })?;
        if x509_version(&cert) == Some(1) {
            let what = if i == 0 {
                what.to_string()
            } else {
                format!("certificate {} of {what}", i + 1)
            };
            return Err(CertError::V1 { what });
        }
    }
    Ok(())
}

/// Checks a PEM file.
pub fn check_file(path: &Path, what: &str) -> Result<(), CertError> {
    let pem = std::fs::read(path).map_err(|e| CertError::Unreadable {
        what: format!("{what} {}", path.display()),
        reason: e.to_string(),
    })?;
    check_pem(&pem, &format!("{what} {}", path.display()))
}

/// Checks the client certificate and CA of the kubeconfig's current context, if the operator
/// runs from a kubeconfig (in a pod it uses its ServiceAccount token, and there is nothing to
/// check).
pub fn check_kubeconfig() -> Result<(), CertError> {
    let Ok(kc) = kube::config::Kubeconfig::read() else {
        return Ok(());
    };
    let Some(context) = kc
        .current_context
        .as_ref()
        .and_then(|c| kc.contexts.iter().find(|n| &n.name == c))
        .and_then(|n| n.context.as_ref())
    else {
        return Ok(());
    };
    let check = |file: &Option<String>, data: &Option<String>, what: String| {
        if let Some(data) = data {
            let pem = base64::engine::general_purpose::STANDARD
                .decode(data.trim())
                .map_err(|e| CertError::Unreadable {
                    what: what.clone(),
                    reason: e.to_string(),
                })?;
            check_pem(&pem, &what)
        } else if let Some(file) = file {
            check_file(Path::new(file), &what)
        } else {
            Ok(())
        }
    };
    if let Some(user) = context.user.as_ref()
        && let Some(auth) = kc
            .auth_infos
            .iter()
            .find(|a| &a.name == user)
            .and_then(|a| a.auth_info.as_ref())
    {
        check(
            &auth.client_certificate,
            &auth.client_certificate_data,
            format!("the kubeconfig's client certificate (user {user:?})"),
        )?;
    }
    if let Some(cluster) = kc
        .clusters
        .iter()
        .find(|c| c.name == context.cluster)
        .and_then(|c| c.cluster.as_ref())
    {
        check(
            &cluster.certificate_authority,
            &cluster.certificate_authority_data,
            format!("the kubeconfig's CA (cluster {:?})", context.cluster),
        )?;
    }
    Ok(())
}

/// A sentence for a failed TLS handshake when the peer's certificate was v1, else `None`.
pub fn explain_handshake(error: &str) -> Option<String> {
    error.contains("UnsupportedCertVersion").then(|| {
        format!(
            "the client presented an X.509 v1 certificate (for the aggregator: its --proxy-client-cert-file); {REISSUE}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rcgen_certificates_are_v3() {
        let c = rcgen::generate_simple_self_signed(vec!["x".into()]).expect("cert");
        assert_eq!(x509_version(c.cert.der()), Some(3));
        assert!(check_pem(c.cert.pem().as_bytes(), "test").is_ok());
    }

    #[test]
    fn the_subjects_common_name_is_read_and_garbage_is_none() {
        let mut params = rcgen::CertificateParams::new(vec!["x".into()]).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "system:masters");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "front-proxy-client");
        let key = rcgen::KeyPair::generate().expect("key");
        let der = params.self_signed(&key).expect("cert").der().to_vec();
        assert_eq!(
            subject_common_name(&der).as_deref(),
            Some("front-proxy-client")
        );
        let mut only_o = rcgen::CertificateParams::new(vec!["x".into()]).expect("params");
        only_o.distinguished_name = rcgen::DistinguishedName::new();
        only_o
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "system:masters");
        let no_cn = only_o.self_signed(&key).expect("cert");
        assert_eq!(subject_common_name(no_cn.der()), None);
        // Every truncation and every single-byte change is an answer, never a panic.
        for cut in 0..der.len() {
            let _ = subject_common_name(&der[..cut]);
        }
        for i in 0..der.len() {
            let mut bad = der.clone();
            bad[i] ^= 0xff;
            let _ = subject_common_name(&bad);
        }
        assert_eq!(subject_common_name(&[]), None);
    }

    #[test]
    fn garbage_has_no_version() {
        assert_eq!(x509_version(&[]), None);
        assert_eq!(x509_version(&[0x30]), None);
        assert_eq!(x509_version(&[0x02, 0x01, 0x00]), None);
    }
}
