//! The test cluster's certificates, all X.509 v3 (rustls, and so kube-rs, refuses v1): a
//! cluster CA with the apiserver's serving certificate and client certificates for the admin
//! and kube-controller-manager; a front-proxy CA and the aggregator's client certificate; and
//! the service-account signing key.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

/// Common names of the two authorities.
pub const CA_NAME: &str = "ferrite-test-ca";
pub const FRONT_PROXY_CA_NAME: &str = "ferrite-test-front-proxy-ca";

/// A certificate and its key, as PEM.
#[derive(Debug, Clone)]
pub struct Pem {
    pub cert: String,
    pub key: String,
}

/// A CA that can issue more certificates.
pub struct Authority {
    pub pem: Pem,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").finish_non_exhaustive()
    }
}

fn dn(common_name: &str, organizations: &[&str]) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    for o in organizations {
        dn.push(DnType::OrganizationName, *o);
    }
    dn
}

fn ca_params(common_name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = dn(common_name, &[]);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

impl Authority {
    pub fn new(common_name: &str) -> Authority {
        let key = KeyPair::generate().expect("CA key");
        let params = ca_params(common_name);
        let cert = params.self_signed(&key).expect("CA certificate");
        let pem = Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        };
        Authority {
            pem,
            issuer: Issuer::new(params, key),
        }
    }

    /// The authority named `common_name`, from its certificate and key (PEM) as
    /// [`Authority::new`] made them: the same subject and key sign as the original.
    pub fn load(common_name: &str, cert: &str, key: &str) -> Authority {
        let signing_key = KeyPair::from_pem(key).expect("CA key parses");
        let issuer = Issuer::new(ca_params(common_name), signing_key);
        Authority {
            pem: Pem {
                cert: cert.to_string(),
                key: key.to_string(),
            },
            issuer,
        }
    }

    /// A client certificate: Kubernetes reads the user from the CN and groups from O.
    pub fn client(&self, user: &str, groups: &[&str]) -> Pem {
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(user, groups);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        self.issue(params)
    }

    /// A serving certificate for these DNS names and IP addresses.
    pub fn server(&self, common_name: &str, names: &[&str]) -> Pem {
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("valid names");
        params.distinguished_name = dn(common_name, &[]);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        self.issue(params)
    }

    fn issue(&self, params: CertificateParams) -> Pem {
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("certificate");
        Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

/// Every file a cluster needs, written under one directory.
#[derive(Debug)]
pub struct Pki {
    pub dir: PathBuf,
    pub ca: Authority,
    pub front_proxy_ca: Authority,
}

impl Pki {
    pub fn create(dir: &Path) -> Pki {
        std::fs::create_dir_all(dir).expect("pki dir");
        let ca = Authority::new(CA_NAME);
        let front_proxy_ca = Authority::new(FRONT_PROXY_CA_NAME);
        let pki = Pki {
            dir: dir.to_path_buf(),
            ca,
            front_proxy_ca,
        };
        pki.write("ca", &pki.ca.pem);
        pki.write("front-proxy-ca", &pki.front_proxy_ca.pem);
        pki.write(
            "apiserver",
            &pki.ca.server(
                "kube-apiserver",
                &[
                    "127.0.0.1",
                    "localhost",
                    "10.0.0.1",
                    "kubernetes",
                    "kubernetes.default",
                    "kubernetes.default.svc",
                    "kubernetes.default.svc.cluster.local",
                ],
            ),
        );
        pki.write(
            "admin",
            &pki.ca.client("ferrite-test-admin", &["system:masters"]),
        );
        pki.write(
            "kube-controller-manager",
            &pki.ca.client("system:kube-controller-manager", &[]),
        );
        pki.write(
            "front-proxy-client",
            &pki.front_proxy_ca.client("front-proxy-client", &[]),
        );
        let sa = KeyPair::generate().expect("service-account key");
        std::fs::write(dir.join("sa.key"), sa.serialize_pem()).expect("sa.key");
        std::fs::write(dir.join("sa.pub"), sa.public_key_pem()).expect("sa.pub");
        pki
    }

    fn write(&self, name: &str, pem: &Pem) {
        std::fs::write(self.dir.join(format!("{name}.crt")), &pem.cert).expect("cert written");
        std::fs::write(self.dir.join(format!("{name}.key")), &pem.key).expect("key written");
    }

    /// `<dir>/<name>.crt` (or `.key`).
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }
}
