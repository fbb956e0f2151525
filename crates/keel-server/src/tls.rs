//! TLS for client connections and HTTPS monitoring, on rustls.
//!
//! - [`parse_block`] reads the reference's `tls { }` keys; [`from_flags`] is `--tls --tlscert
//!   --tlskey --tlscacert --tlsverify`; [`Tls::build`] loads the files into rustls configs (one
//!   for clients, one for `https_port`, which never asks for a client certificate).
//! - [`negotiate`] runs a new client connection's opening the way the reference orders it:
//!   INFO in plain text then the handshake (the default), the handshake before INFO
//!   (`handshake_first`, optionally falling back to plain INFO after a delay), or either one
//!   (`allow_non_tls`: the first byte the client sends tells).
//! - [`PeerTls`] is what a finished handshake leaves on the connection for `/connz`, and
//!   [`CertIdentity`] the client certificate's identity for `verify_and_map`, with the
//!   reference's rules for turning it into a user name ([`CertIdentity::map_user`]).
//!
//! Only the connection setup knows about TLS: afterwards the reader and writer are generic
//! over the stream, so plain connections run exactly the code they ran before.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::crypto::{ring as provider, CryptoProvider, SupportedKxGroup};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{CipherSuite, ProtocolVersion, ServerConfig, SupportedCipherSuite};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

use crate::conf::Value;

/// The reference's default handshake timeout (`TLS_TIMEOUT`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// `handshake_first: auto`: how long to wait for a TLS-first client before sending INFO.
pub const DEFAULT_FALLBACK: Duration = Duration::from_millis(50);

/// The `tls { }` block (or the `--tls*` flags) as given.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TlsOpts {
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub ca_file: Option<PathBuf>,
    /// `certs: [{cert_file, key_file}, ...]`: several server certificates, chosen per client
    /// by the name it asks for (SNI), as Go's TLS stack does.
    pub certs: Vec<(PathBuf, PathBuf)>,
    /// Require and verify client certificates.
    pub verify: bool,
    /// `verify_and_map`: also take the user from the client certificate.
    pub map: bool,
    /// `insecure`: skips verifying the *server's* certificate where the server is the TLS
    /// client; the client listener never is, so it changes nothing there (as in the reference).
    pub insecure: bool,
    pub timeout: Option<Duration>,
    pub handshake_first: bool,
    /// `handshake_first: auto` or a duration: send INFO in plain text when the client sent
    /// nothing within this delay.
    pub fallback: Option<Duration>,
    /// `connection_rate_limit`: TLS handshakes started per second.
    pub rate_limit: i64,
    /// TLS 1.2 cipher suites by Go name (TLS 1.3 suites are not configurable, as in Go).
    pub ciphers: Option<Vec<String>>,
    pub curves: Option<Vec<String>>,
    /// Lower-case hex SHA-256 of the client certificate's SubjectPublicKeyInfo.
    pub pinned: BTreeSet<String>,
    /// `min_version`: "1.2" or "1.3".
    pub min_version: Option<ProtocolVersion>,
}

impl TlsOpts {
    pub fn timeout(&self) -> Duration {
        self.timeout
            .filter(|t| !t.is_zero())
            .unwrap_or(DEFAULT_TIMEOUT)
    }
}

fn not_supported(what: &str) -> String {
    format!("{what} is a nats-server option that keel-server does not support yet")
}

fn file(key: &str, v: &Value) -> Result<PathBuf, String> {
    match v {
        Value::Str(s) => Ok(PathBuf::from(s)),
        _ => Err(format!(
            "error parsing tls config, expected '{key}' to be filename"
        )),
    }
}

fn flag(key: &str, v: &Value) -> Result<bool, String> {
    v.as_bool()
        .ok_or_else(|| format!("error parsing tls config, expected '{key}' to be a boolean"))
}

fn strings(key: &str, v: &Value) -> Result<Vec<String>, String> {
    let items = v
        .as_array()
        .ok_or_else(|| format!("error parsing tls config, expected '{key}' to be a list"))?;
    if items.is_empty() {
        return Err(format!("error parsing tls config, '{key}' cannot be empty"));
    }
    items
        .iter()
        .map(|i| match i {
            Value::Str(s) => Ok(s.clone()),
            _ => Err(format!(
                "error parsing tls config, expected '{key}' to be a list of strings"
            )),
        })
        .collect()
}

/// Go's TLS 1.2 cipher suites that rustls implements, by Go name, in Go's order of
/// preference (AES-128 before AES-256 before ChaCha20, ECDSA before RSA).
const TLS12_SUITES: &[(&str, SupportedCipherSuite)] = &[
    (
        "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
        provider::cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
    ),
    (
        "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
        provider::cipher_suite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
    ),
    (
        "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
        provider::cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
    ),
    (
        "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
        provider::cipher_suite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
    ),
    (
        "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
        provider::cipher_suite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
    ),
    (
        "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
        provider::cipher_suite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
    ),
];

/// TLS 1.3's suites in Go's order of preference (on CPUs with AES instructions).
const TLS13_SUITES: &[SupportedCipherSuite] = &[
    provider::cipher_suite::TLS13_AES_128_GCM_SHA256,
    provider::cipher_suite::TLS13_AES_256_GCM_SHA384,
    provider::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
];

/// Go's TLS 1.3 suite names: accepted, and like in Go they change nothing (TLS 1.3 always
/// offers all three).
const TLS13_NAMES: &[&str] = &[
    "TLS_AES_128_GCM_SHA256",
    "TLS_AES_256_GCM_SHA384",
    "TLS_CHACHA20_POLY1305_SHA256",
];

/// Go's other secure suites (CBC with SHA-1): rustls does not implement CBC.
const GO_CBC_SUITES: &[&str] = &[
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA",
];

/// Go's insecure suites (need `allow_insecure_cipher_suites` in the reference).
const GO_INSECURE_SUITES: &[&str] = &[
    "TLS_RSA_WITH_RC4_128_SHA",
    "TLS_RSA_WITH_3DES_EDE_CBC_SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384",
    "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA",
    "TLS_ECDHE_RSA_WITH_RC4_128_SHA",
    "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256",
];

/// Go's curve names rustls (ring) implements.
const CURVES: &[(&str, &dyn SupportedKxGroup)] = &[
    ("X25519", provider::kx_group::X25519),
    ("CurveP256", provider::kx_group::SECP256R1),
    ("CurveP384", provider::kx_group::SECP384R1),
];
/// Go's other curve names.
const GO_OTHER_CURVES: &[&str] = &[
    "CurveP521",
    "X25519MLKEM768",
    "SecP256r1MLKEM768",
    "SecP384r1MLKEM1024",
];

fn tls_version(v: &Value) -> Result<ProtocolVersion, String> {
    let Value::Str(s) = v else {
        return Err(format!(
            "error parsing tls config: 'min_version' wrong type: {v:?}"
        ));
    };
    match s.as_str() {
        "1.2" => Ok(ProtocolVersion::TLSv1_2),
        "1.3" => Ok(ProtocolVersion::TLSv1_3),
        "1.0" | "1.1" => Err(format!(
            "error parsing tls config: unsupported TLS version: TLS {s}"
        )),
        _ => Err(format!("error parsing tls config: unknown version: {s}")),
    }
}

/// Parses a `tls { }` block of the client listener with the reference's keys and error texts.
pub fn parse_block(v: &Value) -> Result<TlsOpts, String> {
    let Value::Map(m) = v else {
        return Err("error parsing tls config, expected a block".into());
    };
    let mut t = TlsOpts::default();
    let mut allow_insecure = false;
    for (k, v) in &m.0 {
        match k.to_ascii_lowercase().as_str() {
            "cert_file" => t.cert_file = Some(file(k, v)?),
            "key_file" => t.key_file = Some(file(k, v)?),
            "ca_file" => t.ca_file = Some(file(k, v)?),
            "insecure" => t.insecure = flag(k, v)?,
            "verify" => t.verify = flag(k, v)?,
            "verify_and_map" => {
                let on = flag(k, v)?;
                if on {
                    t.verify = true;
                }
                t.map = on;
            }
            "verify_cert_and_check_known_urls" => {
                // Only meaningful for cluster, gateway and leaf listeners.
                if flag(k, v)? {
                    return Err(
                        "verify_cert_and_check_known_urls not supported in this context".into(),
                    );
                }
            }
            "allow_insecure_cipher_suites" => allow_insecure = flag(k, v)?,
            "cipher_suites" => t.ciphers = Some(strings(k, v)?),
            "curve_preferences" => t.curves = Some(strings(k, v)?),
            "timeout" => {
                t.timeout = Some(match v {
                    Value::Int(_) | Value::Float(_) => v.as_duration().map_err(|_| {
                        "error parsing tls config, 'timeout' wrong type".to_string()
                    })?,
                    Value::Str(s) => crate::conf::parse_duration(s)
                        .map_err(|e| format!("error parsing tls config, 'timeout' {e}"))?,
                    _ => return Err("error parsing tls config, 'timeout' wrong type".into()),
                })
            }
            "connection_rate_limit" => {
                t.rate_limit = v.as_i64().ok_or_else(|| {
                    "error parsing tls config, 'connection_rate_limit' wrong type".to_string()
                })?
            }
            "pinned_certs" => {
                let items = v.as_array().ok_or_else(|| {
                    "error parsing tls config, expected 'pinned_certs' to be a list of hex-encoded sha256 of DER encoded SubjectPublicKeyInfo".to_string()
                })?;
                for i in items {
                    let entry = i.as_str().unwrap_or_default().to_ascii_lowercase();
                    if entry.len() != 64 || !entry.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return Err(format!("error parsing tls config, 'pinned_certs' key {entry} does not look like hex-encoded sha256 of DER encoded SubjectPublicKeyInfo"));
                    }
                    t.pinned.insert(entry);
                }
            }
            "handshake_first" | "first" | "immediate" => match v {
                Value::Bool(b) => t.handshake_first = *b,
                Value::Str(s) => match s.to_ascii_lowercase().as_str() {
                    "true" | "on" => t.handshake_first = true,
                    "false" | "off" => t.handshake_first = false,
                    "auto" | "auto_fallback" => {
                        t.handshake_first = true;
                        t.fallback = Some(DEFAULT_FALLBACK);
                    }
                    _ => match crate::conf::parse_duration(s) {
                        Ok(d) => {
                            t.handshake_first = true;
                            t.fallback = Some(d).filter(|d| !d.is_zero());
                        }
                        Err(_) => return Err(format!("field {k:?}'s value {s:?} is invalid")),
                    },
                },
                other => {
                    return Err(format!(
                        "field {k:?} should be a boolean or a string, got {}",
                        other.type_name()
                    ))
                }
            },
            "certs" | "certificates" => {
                let items = v.as_array().ok_or_else(|| {
                    format!(
                        "error parsing certificates config: unsupported type {}",
                        v.type_name()
                    )
                })?;
                for i in items {
                    let pair = i.as_map().ok_or_else(|| {
                        format!(
                            "error parsing certificates config: unsupported type {}",
                            i.type_name()
                        )
                    })?;
                    let (mut cert, mut key) = (None, None);
                    for (pk, pv) in &pair.0 {
                        let Value::Str(f) = pv else {
                            return Err(format!(
                                "error parsing certificates config: unsupported type {}",
                                pv.type_name()
                            ));
                        };
                        match pk.as_str() {
                            "cert_file" => cert = Some(PathBuf::from(f)),
                            "key_file" => key = Some(PathBuf::from(f)),
                            _ => {
                                return Err(format!(
                                    "error parsing tls certs config, unknown field {pk:?}"
                                ))
                            }
                        }
                    }
                    match (cert, key) {
                        (Some(c), Some(k)) => t.certs.push((c, k)),
                        _ => return Err("error parsing certificates config: both 'cert_file' and 'cert_key' options are required".into()),
                    }
                }
            }
            "min_version" => t.min_version = Some(tls_version(v)?),
            // The Windows certificate store and OCSP checks of client certificates.
            "cert_store"
            | "cert_match_by"
            | "cert_match"
            | "cert_match_skip_invalid"
            | "ca_certs_match"
            | "ocsp_peer" => return Err(not_supported(&format!("tls configuration key {k:?}"))),
            _ => return Err(format!("error parsing tls config, unknown field {k:?}")),
        }
    }
    if !t.certs.is_empty() && t.cert_file.is_some() {
        return Err(
            "error parsing tls config, cannot combine 'cert_file' option with 'certs' option"
                .into(),
        );
    }
    if let Some(names) = &t.ciphers {
        let mut insecure = vec![];
        for n in names {
            let known = TLS12_SUITES.iter().any(|(g, _)| g == n)
                || TLS13_NAMES.contains(&n.as_str())
                || GO_CBC_SUITES.contains(&n.as_str());
            if GO_INSECURE_SUITES.contains(&n.as_str()) {
                insecure.push(n.as_str());
            } else if !known {
                return Err(format!("unrecognized cipher {n}"));
            }
        }
        if !allow_insecure && !insecure.is_empty() {
            return Err(format!("insecure cipher suites configured without 'allow_insecure_cipher_suites' option set: {}", insecure.join(", ")));
        }
        // Valid for the reference, but not something rustls implements.
        if let Some(n) = names.iter().find(|n| {
            GO_INSECURE_SUITES.contains(&n.as_str()) || GO_CBC_SUITES.contains(&n.as_str())
        }) {
            return Err(not_supported(&format!(
                "tls cipher suite {n:?} (keel-server offers the AEAD suites with ECDHE only)"
            )));
        }
    }
    if let Some(names) = &t.curves {
        for n in names {
            if GO_OTHER_CURVES.contains(&n.as_str()) {
                return Err(not_supported(&format!(
                    "tls curve preference {n:?} (keel-server offers X25519, CurveP256 and CurveP384)"
                )));
            }
            if !CURVES.iter().any(|(g, _)| g == n) {
                return Err(format!("unrecognized curve preference {n}"));
            }
        }
    }
    Ok(t)
}

/// The `--tls*` flags override the TLS setup of the config file, keeping its timeout, mapping,
/// pins, rate limit and handshake order (the reference replaces only its `tls.Config`).
pub fn from_flags(
    base: Option<&TlsOpts>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    ca: Option<PathBuf>,
    verify: bool,
) -> Result<TlsOpts, String> {
    let cert = cert.ok_or("TLS Server certificate must be present and valid")?;
    let key = key.ok_or("TLS Server private key must be present and valid")?;
    let base = base.cloned().unwrap_or_default();
    Ok(TlsOpts {
        cert_file: Some(cert),
        key_file: Some(key),
        ca_file: ca,
        certs: vec![],
        verify,
        ciphers: None,
        curves: None,
        min_version: None,
        insecure: false,
        ..base
    })
}

/// TLS as the server runs it: the options plus the loaded rustls configs.
pub struct Tls {
    pub opts: TlsOpts,
    /// `allow_non_tls`: plain clients are served too.
    pub allow_non_tls: bool,
    pub client: Arc<ServerConfig>,
    /// For `https_port`: the same certificates, never asking for a client certificate.
    pub monitor: Arc<ServerConfig>,
    /// Unix seconds of the (first) server certificate's `notAfter` (`/varz`).
    pub cert_not_after: Option<i64>,
    rate: Option<RateCounter>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("opts", &self.opts)
            .field("allow_non_tls", &self.allow_non_tls)
            .finish_non_exhaustive()
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let text = std::fs::read(path).map_err(|e| format!("open {}: {e}", path.display()))?;
    CertificateDer::pem_slice_iter(&text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn load_pair(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
    let chain = read_certs(cert)?;
    if chain.is_empty() {
        return Err(format!(
            "tls: failed to find any PEM data in certificate input ({})",
            cert.display()
        ));
    }
    let text = std::fs::read(key).map_err(|e| format!("open {}: {e}", key.display()))?;
    let key = PrivateKeyDer::from_pem_slice(&text).map_err(|_| {
        format!(
            "tls: failed to find any PEM data in key input ({})",
            key.display()
        )
    })?;
    Ok((chain, key))
}

/// One server certificate with the names it answers for (SNI choice among `certs`).
#[derive(Debug)]
struct ServerCert {
    key: Arc<CertifiedKey>,
    names: Vec<String>,
}

/// Go's choice among several certificates: the first whose names match the SNI name and
/// whose key the client can verify, else the first.
#[derive(Debug)]
struct CertChooser(Vec<ServerCert>);

fn name_matches(pattern: &str, host: &str) -> bool {
    let (p, h) = (pattern.to_ascii_lowercase(), host.to_ascii_lowercase());
    let h = h.trim_end_matches('.');
    if let Some(rest) = p.strip_prefix("*.") {
        return h.split_once('.').is_some_and(|(_, tail)| tail == rest);
    }
    p == h
}

impl ResolvesServerCert for CertChooser {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let sni = hello.server_name();
        let schemes = hello.signature_schemes();
        self.0
            .iter()
            .find(|c| {
                sni.is_none_or(|s| c.names.iter().any(|n| name_matches(n, s)))
                    && c.key.key.choose_scheme(schemes).is_some()
            })
            .or_else(|| self.0.first())
            .map(|c| c.key.clone())
    }
}

impl Tls {
    /// Loads the certificates and builds the rustls configs; errors are the config's errors.
    pub fn build(opts: TlsOpts, allow_non_tls: bool) -> Result<Tls, String> {
        let mut pairs = opts.certs.clone();
        match (&opts.cert_file, &opts.key_file) {
            (Some(_), None) => return Err("missing 'key_file' in TLS configuration".into()),
            (None, Some(_)) => return Err("missing 'cert_file' in TLS configuration".into()),
            (Some(c), Some(k)) => pairs.insert(0, (c.clone(), k.clone())),
            (None, None) => {}
        }
        if pairs.is_empty() {
            // The reference would start and fail every handshake ("no certificates
            // configured"); refusing is clearer.
            return Err("TLS configuration needs 'cert_file' and 'key_file' (or 'certs')".into());
        }
        let ciphers: Vec<SupportedCipherSuite> = {
            let tls13 = TLS13_SUITES.iter();
            let tls12: Vec<SupportedCipherSuite> = match &opts.ciphers {
                None => TLS12_SUITES.iter().map(|(_, s)| *s).collect(),
                Some(names) => names
                    .iter()
                    .filter_map(|n| TLS12_SUITES.iter().find(|(g, _)| g == n).map(|(_, s)| *s))
                    .collect(),
            };
            tls13.copied().chain(tls12).collect()
        };
        let kx_groups: Vec<&'static dyn SupportedKxGroup> = match &opts.curves {
            None => provider::ALL_KX_GROUPS.to_vec(),
            Some(names) => names
                .iter()
                .filter_map(|n| CURVES.iter().find(|(g, _)| g == n).map(|(_, k)| *k))
                .collect(),
        };
        let provider = Arc::new(CryptoProvider {
            cipher_suites: ciphers,
            kx_groups,
            ..provider::default_provider()
        });
        let versions: &[&'static rustls::SupportedProtocolVersion] = match opts.min_version {
            Some(ProtocolVersion::TLSv1_3) => &[&rustls::version::TLS13],
            _ => &[&rustls::version::TLS13, &rustls::version::TLS12],
        };

        let mut certs = Vec::new();
        let mut cert_not_after = None;
        for (i, (c, k)) in pairs.iter().enumerate() {
            let (chain, key) = load_pair(c, k).map_err(|e| {
                if pairs.len() > 1 {
                    format!(
                        "error parsing X509 certificate/key pair {}/{}: {e}",
                        i + 1,
                        pairs.len()
                    )
                } else {
                    format!("error parsing X509 certificate/key pair: {e}")
                }
            })?;
            let parsed = x509_parser::parse_x509_certificate(&chain[0])
                .map_err(|e| format!("error parsing certificate: {e}"))?
                .1;
            if i == 0 {
                cert_not_after = Some(parsed.validity().not_after.timestamp());
            }
            let names = cert_names(&parsed);
            let certified = CertifiedKey::from_der(chain, key, &provider).map_err(|e| {
                format!(
                    "error parsing X509 certificate/key pair: {}",
                    rustls_text(&e)
                )
            })?;
            certs.push(ServerCert {
                key: Arc::new(certified),
                names,
            });
        }
        let chooser = Arc::new(CertChooser(certs));

        let builder = || {
            ServerConfig::builder_with_provider(provider.clone())
                .with_protocol_versions(versions)
                .map_err(|e| format!("TLS configuration: {e}"))
        };
        let client = if opts.verify {
            let mut roots = rustls::RootCertStore::empty();
            match &opts.ca_file {
                Some(ca) => {
                    let text =
                        std::fs::read(ca).map_err(|e| format!("open {}: {e}", ca.display()))?;
                    for c in CertificateDer::pem_slice_iter(&text).flatten() {
                        let _ = roots.add(c);
                    }
                    if roots.is_empty() {
                        return Err("failed to parse root ca certificate".into());
                    }
                }
                None => {
                    for c in rustls_native_certs::load_native_certs().certs {
                        let _ = roots.add(c);
                    }
                    if roots.is_empty() {
                        return Err(
                            "tls: 'verify' without 'ca_file' needs the system's root certificates, and none were found"
                                .into(),
                        );
                    }
                }
            }
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|e| format!("TLS client verification: {e}"))?;
            builder()?
                .with_client_cert_verifier(verifier)
                .with_cert_resolver(chooser.clone())
        } else {
            builder()?
                .with_no_client_auth()
                .with_cert_resolver(chooser.clone())
        };
        let mut client = client;
        let mut monitor = builder()?.with_no_client_auth().with_cert_resolver(chooser);
        // The server's order of suites decides, as in Go.
        client.ignore_client_order = true;
        monitor.ignore_client_order = true;
        let rate = (opts.rate_limit > 0).then(|| RateCounter::new(opts.rate_limit));
        Ok(Tls {
            opts,
            allow_non_tls,
            client: Arc::new(client),
            monitor: Arc::new(monitor),
            cert_not_after,
            rate,
        })
    }

    /// INFO's `tls_required`: TLS is configured and plain clients are not allowed.
    pub fn required(&self) -> bool {
        !self.allow_non_tls
    }

    /// Only TLS-first clients can connect (`handshake_first` without a fallback delay).
    pub fn first_only(&self) -> bool {
        self.opts.handshake_first && self.opts.fallback.is_none()
    }

    /// Handshakes turned away by `connection_rate_limit` since the last call.
    pub fn take_rejected(&self) -> u64 {
        self.rate.as_ref().map_or(0, |r| r.take_blocked())
    }

    pub fn has_rate_limit(&self) -> bool {
        self.rate.is_some()
    }
}

fn cert_names(c: &x509_parser::certificate::X509Certificate<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let mut names = vec![];
    if let Ok(Some(san)) = c.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                GeneralName::DNSName(d) => names.push(d.to_string()),
                GeneralName::IPAddress(ip) => {
                    if let Ok(a) = <[u8; 4]>::try_from(*ip) {
                        names.push(std::net::IpAddr::from(a).to_string());
                    } else if let Ok(a) = <[u8; 16]>::try_from(*ip) {
                        names.push(std::net::IpAddr::from(a).to_string());
                    }
                }
                _ => {}
            }
        }
    }
    names
}

/// The reference's per-second handshake counter (`connection_rate_limit`).
#[derive(Debug)]
struct RateCounter {
    limit: i64,
    state: Mutex<(i64, Option<Instant>, u64)>,
}

impl RateCounter {
    fn new(limit: i64) -> Self {
        RateCounter {
            limit,
            state: Mutex::new((0, None, 0)),
        }
    }

    fn allow(&self) -> bool {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (count, end, blocked) = &mut *s;
        if end.is_none_or(|e| now > e) {
            *count = 0;
            *end = Some(now + Duration::from_secs(1));
        } else {
            *count += 1;
        }
        let ok = *count < self.limit;
        if !ok {
            *blocked += 1;
        }
        ok
    }

    fn take_blocked(&self) -> u64 {
        std::mem::take(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()).2)
    }
}

// ---------------------------------------------------------------------------
// The connection's opening
// ---------------------------------------------------------------------------

/// How a connection goes on after its opening.
pub enum Opened {
    Tls(Box<TlsStream<TcpStream>>),
    /// `allow_non_tls` and the client did not start a handshake.
    Plain(TcpStream),
}

/// Why the opening failed (the connection is closed; it was logged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failed {
    Handshake,
    Throttled,
    Write,
}

/// The reference's prefix of a client's log lines.
pub fn log_prefix(addr: Option<SocketAddr>, id: u64) -> String {
    match addr {
        Some(a) => format!("{a} - cid:{id} - "),
        None => format!("cid:{id} - "),
    }
}

/// What the client sent first, looked at without taking it from the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum First {
    Byte(u8),
    Nothing,
    Closed,
}

/// Waits up to `wait` for the client's first byte.
async fn first_byte(stream: &TcpStream, wait: Duration) -> First {
    let mut b = [0u8; 1];
    match tokio::time::timeout(wait, stream.peek(&mut b)).await {
        Ok(Ok(1)) => First::Byte(b[0]),
        Ok(_) => First::Closed,
        Err(_) => First::Nothing,
    }
}

/// A TLS connection starts with a handshake record.
const HANDSHAKE_RECORD: u8 = 0x16;

async fn write_plain(stream: &mut TcpStream, bytes: &[u8], deadline: Duration) -> bool {
    matches!(
        tokio::time::timeout(deadline, stream.write_all(bytes)).await,
        Ok(Ok(()))
    )
}

/// What a new connection needs from the server for its opening.
pub struct Opening<'a> {
    pub tls: &'a Tls,
    pub log: &'a crate::log::Log,
    pub id: u64,
    pub addr: Option<SocketAddr>,
    /// INFO; the argument forces `tls_required` (the INFO of a TLS-first client).
    pub info: &'a (dyn Fn(bool) -> Vec<u8> + Sync),
    pub write_deadline: Duration,
}

/// Runs the opening of a connection on a TLS-enabled listener, in the reference's order.
/// On success, `tls_first` tells whether INFO still has to be sent (over TLS).
pub async fn negotiate(o: &Opening<'_>, mut stream: TcpStream) -> Result<(Opened, bool), Failed> {
    let p = log_prefix(o.addr, o.id);
    let opts = &o.tls.opts;
    let mut tls_first = opts.handshake_first;
    let mut do_tls = o.tls.required() || tls_first;
    if !tls_first && !write_plain(&mut stream, &(o.info)(false), o.write_deadline).await {
        return Err(Failed::Write);
    }
    if tls_first {
        if let Some(delay) = opts.fallback {
            // Only a TLS-first client speaks before INFO.
            if first_byte(&stream, delay).await == First::Nothing {
                if !write_plain(&mut stream, &(o.info)(false), o.write_deadline).await {
                    return Err(Failed::Write);
                }
                tls_first = false;
                do_tls = o.tls.required();
            }
        }
    }
    if !tls_first && o.tls.allow_non_tls {
        // A TLS ClientHello starts with the handshake record type.
        do_tls = first_byte(&stream, opts.timeout()).await == First::Byte(HANDSHAKE_RECORD);
    }
    if !do_tls {
        return Ok((Opened::Plain(stream), false));
    }
    if let Some(rate) = &o.tls.rate {
        if !rate.allow() {
            let mut b = bytes::BytesMut::new();
            keel_protocol::encode::err(
                &mut b,
                "Connection throttling is active. Please try again later.",
            );
            let _ = write_plain(&mut stream, &b, o.write_deadline).await;
            return Err(Failed::Throttled);
        }
    }
    crate::debug!(o.log, "{p}Starting TLS client connection handshake");
    let local = stream.local_addr().ok();
    let deadline = tokio::time::Instant::now() + opts.timeout();
    let timed_out = || {
        let (l, r) = (
            local.map(|a| a.to_string()).unwrap_or_default(),
            o.addr.map(|a| a.to_string()).unwrap_or_default(),
        );
        crate::debug!(
            o.log,
            "{p}TLS handshake error: read tcp {l}->{r}: i/o timeout"
        );
        Err(Failed::Handshake)
    };
    // A client that is not speaking TLS is turned away before rustls would answer it with an
    // alert: the reference closes such a connection without sending anything.
    match first_byte(&stream, opts.timeout()).await {
        First::Byte(HANDSHAKE_RECORD) => {}
        First::Byte(_) => {
            crate::debug!(
                o.log,
                "{p}TLS handshake error: tls: first record does not look like a TLS handshake"
            );
            // Take what the client sent, so closing ends the connection with FIN, not RST.
            let mut scratch = [0u8; 4096];
            while matches!(stream.try_read(&mut scratch), Ok(n) if n > 0) {}
            return Err(Failed::Handshake);
        }
        First::Closed => {
            crate::error!(o.log, "{p}TLS handshake error: EOF");
            return Err(Failed::Handshake);
        }
        First::Nothing => return timed_out(),
    }
    let acceptor = tokio_rustls::TlsAcceptor::from(o.tls.client.clone());
    let s = match tokio::time::timeout_at(deadline, acceptor.accept(stream)).await {
        Err(_) => return timed_out(),
        Ok(Err(e)) => {
            let (text, probe) = handshake_error_text(&e, local, o.addr);
            if probe {
                crate::debug!(o.log, "{p}TLS handshake error: {text}");
            } else {
                crate::error!(o.log, "{p}TLS handshake error: {text}");
            }
            return Err(Failed::Handshake);
        }
        Ok(Ok(s)) => s,
    };
    if !opts.pinned.is_empty() {
        let spki = s
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|c| spki_sha256(c));
        match spki {
            None => {
                crate::debug!(
                    o.log,
                    "{p}Failed pinned cert test as client did not provide a certificate"
                );
                crate::error!(o.log, "{p}TLS handshake error: certificate not pinned");
                return Err(Failed::Handshake);
            }
            Some(key) if !opts.pinned.contains(&key) => {
                crate::debug!(o.log, "{p}Failed pinned cert test for key id: {key}");
                crate::error!(o.log, "{p}TLS handshake error: certificate not pinned");
                return Err(Failed::Handshake);
            }
            Some(_) => {}
        }
    }
    crate::debug!(o.log, "{p}TLS handshake complete");
    Ok((Opened::Tls(Box::new(s)), tls_first))
}

/// Go's wording for a failed handshake, and whether it is the kind the reference logs only
/// at debug level (a load balancer's probe, a client that is not speaking TLS).
fn handshake_error_text(
    e: &std::io::Error,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
) -> (String, bool) {
    use std::io::ErrorKind;
    if let Some(r) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        if matches!(
            r,
            rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType)
        ) {
            return (
                "tls: first record does not look like a TLS handshake".into(),
                true,
            );
        }
        return (rustls_text(r), false);
    }
    let (l, p) = (
        local.map(|a| a.to_string()).unwrap_or_default(),
        peer.map(|a| a.to_string()).unwrap_or_default(),
    );
    match e.kind() {
        ErrorKind::UnexpectedEof => ("EOF".into(), false),
        ErrorKind::ConnectionReset => (
            format!("read tcp {l}->{p}: read: connection reset by peer"),
            false,
        ),
        _ => (format!("read tcp {l}->{p}: {e}"), false),
    }
}

/// Go's texts for the rustls errors a client can cause.
fn rustls_text(e: &rustls::Error) -> String {
    use rustls::{AlertDescription as A, CertificateError as C, Error as E, PeerIncompatible as P};
    match e {
        E::NoCertificatesPresented => "tls: client didn't provide a certificate".into(),
        E::InvalidCertificate(C::UnknownIssuer) | E::InvalidCertificate(C::BadSignature) => {
            "tls: failed to verify certificate: x509: certificate signed by unknown authority".into()
        }
        E::InvalidCertificate(C::Expired | C::ExpiredContext { .. } | C::NotValidYet | C::NotValidYetContext { .. }) => {
            "tls: failed to verify certificate: x509: certificate has expired or is not yet valid".into()
        }
        E::InvalidCertificate(C::InvalidPurpose | C::InvalidPurposeContext { .. }) => {
            "tls: failed to verify certificate: x509: certificate specifies an incompatible key usage".into()
        }
        E::InvalidCertificate(other) => format!("tls: failed to verify certificate: {other:?}"),
        E::PeerIncompatible(P::NoCipherSuitesInCommon) => {
            "tls: no cipher suite supported by both client and server".into()
        }
        E::PeerIncompatible(P::NoKxGroupsInCommon) => {
            "tls: no ECDHE curve supported by both client and server".into()
        }
        E::PeerIncompatible(P::Tls12NotOfferedOrEnabled | P::Tls13RequiredForQuic | P::SupportedVersionsExtensionRequired) => {
            "tls: client offered only unsupported versions".into()
        }
        E::AlertReceived(a) => {
            let text = match a {
                A::BadCertificate => "bad certificate",
                A::UnsupportedCertificate => "unsupported certificate",
                A::CertificateRevoked => "revoked certificate",
                A::CertificateExpired => "expired certificate",
                A::CertificateUnknown => "unknown certificate",
                A::UnknownCA => "unknown certificate authority",
                A::HandshakeFailure => "handshake failure",
                A::ProtocolVersion => "protocol version not supported",
                A::DecryptError => "error decrypting message",
                A::DecodeError => "error decoding message",
                A::IllegalParameter => "illegal parameter",
                A::AccessDenied => "access denied",
                A::InsufficientSecurity => "insufficient security level",
                A::InternalError => "internal error",
                A::UserCanceled => "user canceled",
                A::CertificateRequired => "certificate required",
                A::UnexpectedMessage => "unexpected message",
                A::CloseNotify => "close notify",
                _ => return format!("remote error: tls: {a:?}"),
            };
            format!("remote error: tls: {text}")
        }
        other => format!("tls: {other}"),
    }
}

// ---------------------------------------------------------------------------
// What a finished handshake tells about the client
// ---------------------------------------------------------------------------

/// One certificate the client presented, as `/connz` `tls_peer_certs` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCert {
    /// Go's `Subject.String()`.
    pub subject: String,
    pub spki_sha256: String,
    pub cert_sha256: String,
}

/// The TLS state of one connection.
#[derive(Debug, Clone)]
pub struct PeerTls {
    /// `1.2` or `1.3`, as the reference writes it.
    pub version: &'static str,
    /// Go's name of the suite.
    pub cipher: &'static str,
    pub certs: Vec<PeerCert>,
    /// The handshake came before INFO (`handshake_first`).
    pub first: bool,
    /// The leaf certificate's identity, kept with `verify_and_map`.
    pub identity: Option<CertIdentity>,
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

fn spki_sha256(der: &CertificateDer<'_>) -> Option<String> {
    let (_, c) = x509_parser::parse_x509_certificate(der).ok()?;
    Some(hex(&Sha256::digest(c.public_key().raw)))
}

fn cipher_name(s: CipherSuite) -> &'static str {
    match s {
        CipherSuite::TLS13_AES_128_GCM_SHA256 => "TLS_AES_128_GCM_SHA256",
        CipherSuite::TLS13_AES_256_GCM_SHA384 => "TLS_AES_256_GCM_SHA384",
        CipherSuite::TLS13_CHACHA20_POLY1305_SHA256 => "TLS_CHACHA20_POLY1305_SHA256",
        other => TLS12_SUITES
            .iter()
            .find(|(_, s)| s.suite() == other)
            .map_or("unknown", |(n, _)| n),
    }
}

impl PeerTls {
    /// Reads a finished server-side connection.
    pub fn of(conn: &rustls::ServerConnection, first: bool, map: bool) -> PeerTls {
        let version = match conn.protocol_version() {
            Some(ProtocolVersion::TLSv1_3) => "1.3",
            Some(ProtocolVersion::TLSv1_2) => "1.2",
            _ => "unknown",
        };
        let cipher = conn
            .negotiated_cipher_suite()
            .map_or("unknown", |s| cipher_name(s.suite()));
        let mut certs = vec![];
        let mut identity = None;
        for (i, der) in conn
            .peer_certificates()
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            let Ok((_, c)) = x509_parser::parse_x509_certificate(der) else {
                continue;
            };
            certs.push(PeerCert {
                subject: go_subject(c.subject()),
                spki_sha256: hex(&Sha256::digest(c.public_key().raw)),
                cert_sha256: hex(&Sha256::digest(der.as_ref())),
            });
            if i == 0 && map {
                identity = Some(CertIdentity::of(&c));
            }
        }
        PeerTls {
            version,
            cipher,
            certs,
            first,
            identity,
        }
    }
}

// ---------------------------------------------------------------------------
// Go's names for subjects, and verify_and_map
// ---------------------------------------------------------------------------

/// Attribute type names Go prints (`crypto/x509/pkix`).
fn go_type_name(oid: &str) -> Option<&'static str> {
    Some(match oid {
        "2.5.4.6" => "C",
        "2.5.4.10" => "O",
        "2.5.4.11" => "OU",
        "2.5.4.3" => "CN",
        "2.5.4.5" => "SERIALNUMBER",
        "2.5.4.7" => "L",
        "2.5.4.8" => "ST",
        "2.5.4.9" => "STREET",
        "2.5.4.17" => "POSTALCODE",
        _ => return None,
    })
}

/// Go's escaping of an attribute value (`RDNSequence.String`).
fn go_escape(v: &str) -> String {
    let n = v.chars().count();
    let mut out = String::with_capacity(v.len());
    for (k, c) in v.chars().enumerate() {
        let escape = match c {
            ',' | '+' | '"' | '\\' | '<' | '>' | ';' => true,
            ' ' => k == 0 || k + 1 == n,
            '#' => k == 0,
            _ => false,
        };
        if escape {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// One attribute of a subject: its OID (dotted), and its value when it is a string.
type Atv = (String, Option<String>, Vec<u8>);

fn attributes(name: &x509_parser::x509::X509Name<'_>) -> Vec<Vec<Atv>> {
    name.iter()
        .map(|rdn| {
            rdn.iter()
                .map(|a| {
                    (
                        a.attr_type().to_id_string(),
                        a.as_str().ok().map(str::to_string),
                        a.attr_value().data.to_vec(),
                    )
                })
                .collect()
        })
        .collect()
}

/// The RDNs Go builds from a parsed name's known attributes (`Name.ToRDNSequence`): C, ST, L,
/// STREET, POSTALCODE, O, OU (each all values in one RDN), then CN and SERIALNUMBER (the last
/// value of each).
fn known_rdns(attrs: &[Vec<Atv>]) -> Vec<Vec<(&'static str, String)>> {
    let flat: Vec<&Atv> = attrs.iter().flatten().collect();
    let values = |oid: &str| -> Vec<String> {
        flat.iter()
            .filter(|(o, v, _)| o == oid && v.is_some())
            .filter_map(|(_, v, _)| v.clone())
            .collect()
    };
    let mut rdns = vec![];
    for oid in [
        "2.5.4.6", "2.5.4.8", "2.5.4.7", "2.5.4.9", "2.5.4.17", "2.5.4.10", "2.5.4.11",
    ] {
        let vs = values(oid);
        if !vs.is_empty() {
            let t = go_type_name(oid).unwrap_or_default();
            rdns.push(vs.into_iter().map(|v| (t, v)).collect());
        }
    }
    for oid in ["2.5.4.3", "2.5.4.5"] {
        if let Some(v) = values(oid).pop().filter(|v| !v.is_empty()) {
            rdns.push(vec![(go_type_name(oid).unwrap_or_default(), v)]);
        }
    }
    rdns
}

fn rdns_string(rdns: &[Vec<(String, String)>]) -> String {
    rdns.iter()
        .rev()
        .map(|rdn| {
            rdn.iter()
                .map(|(t, v)| format!("{t}={v}"))
                .collect::<Vec<_>>()
                .join("+")
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Go's `pkix.Name.String()` of a certificate's subject: the other attributes (by OID) last,
/// then the known ones in Go's fixed order, all from the last RDN to the first.
pub fn go_subject(name: &x509_parser::x509::X509Name<'_>) -> String {
    let attrs = attributes(name);
    let mut rdns: Vec<Vec<(String, String)>> = vec![];
    for (oid, v, raw) in attrs.iter().flatten() {
        if go_type_name(oid).is_some() {
            continue;
        }
        let value = match v {
            Some(s) => go_escape(s),
            None => format!("#{}", hex(raw)),
        };
        rdns.push(vec![(oid.clone(), value)]);
    }
    for rdn in known_rdns(&attrs) {
        rdns.push(
            rdn.into_iter()
                .map(|(t, v)| (t.to_string(), go_escape(&v)))
                .collect(),
        );
    }
    rdns_string(&rdns)
}

/// A distinguished name as the reference compares them for `verify_and_map`: RDNs of
/// (type, value) attributes, types compared without case, values exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dn(pub Vec<Vec<(String, String)>>);

fn attr_eq(a: &(String, String), b: &(String, String)) -> bool {
    a.0.eq_ignore_ascii_case(&b.0) && a.1 == b.1
}

fn rdn_eq(a: &[(String, String)], b: &[(String, String)]) -> bool {
    a.len() == b.len()
        && a.iter().all(|x| b.iter().any(|y| attr_eq(x, y)))
        && b.iter().all(|x| a.iter().any(|y| attr_eq(x, y)))
}

impl Dn {
    /// Parses a user name written as a DN (`CN=alice,O=Acme`), with the reference's rules
    /// (RFC 4514 escapes, `\XX` hex octets; `#` BER values are refused).
    pub fn parse(s: &str) -> Result<Dn, String> {
        let b = s.as_bytes();
        let mut rdns = vec![];
        let mut rdn: Vec<(String, String)> = vec![];
        let mut buf: Vec<u8> = vec![];
        let mut typ: Option<String> = None;
        let mut trailing = 0usize;
        let take = |buf: &mut Vec<u8>, trailing: &mut usize| -> String {
            let n = buf.len() - *trailing;
            let s = String::from_utf8_lossy(&buf[..n]).into_owned();
            buf.clear();
            *trailing = 0;
            s
        };
        let mut i = 0;
        while i < b.len() {
            let c = b[i];
            match c {
                b'\\' => {
                    trailing = 0;
                    let Some(&next) = b.get(i + 1) else {
                        return Err("got corrupted escaped character".into());
                    };
                    if b" \"#+,;<=>\\".contains(&next) {
                        buf.push(next);
                        i += 2;
                        continue;
                    }
                    let hexpair = b
                        .get(i + 1..i + 3)
                        .and_then(|h| std::str::from_utf8(h).ok())
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                        .ok_or("failed to decode escaped character")?;
                    buf.push(hexpair);
                    i += 3;
                    continue;
                }
                b'=' if typ.is_none() => {
                    typ = Some(take(&mut buf, &mut trailing));
                    if b.get(i + 1) == Some(&b'#') {
                        return Err("unsupported BER encoding".into());
                    }
                }
                b',' | b'+' => {
                    let t = typ.take().filter(|t| !t.is_empty());
                    let Some(t) = t else {
                        return Err("incomplete type, value pair".into());
                    };
                    rdn.push((t, take(&mut buf, &mut trailing)));
                    if c == b',' {
                        rdns.push(std::mem::take(&mut rdn));
                    }
                }
                b' ' if buf.is_empty() => {}
                _ => {
                    if c == b' ' {
                        trailing += 1;
                    } else {
                        trailing = 0;
                    }
                    buf.push(c);
                }
            }
            i += 1;
        }
        if !buf.is_empty() {
            let Some(t) = typ.filter(|t| !t.is_empty()) else {
                return Err("DN ended with incomplete type, value pair".into());
            };
            rdn.push((t, take(&mut buf, &mut trailing)));
            rdns.push(rdn);
        }
        Ok(Dn(rdns))
    }

    /// Same RDNs in the same order.
    pub fn equal(&self, o: &Dn) -> bool {
        self.0.len() == o.0.len() && self.0.iter().zip(&o.0).all(|(a, b)| rdn_eq(a, b))
    }

    /// Same RDNs in any order.
    pub fn rdns_match(&self, o: &Dn) -> bool {
        if self.0.len() != o.0.len() {
            return false;
        }
        let mut used = vec![false; o.0.len()];
        self.0.iter().all(|a| {
            match o
                .0
                .iter()
                .enumerate()
                .find(|(j, b)| !used[*j] && rdn_eq(a, b))
            {
                Some((j, _)) => {
                    used[j] = true;
                    true
                }
                None => false,
            }
        })
    }
}

/// What `verify_and_map` can map to a user, read from the client's leaf certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CertIdentity {
    pub emails: Vec<String>,
    pub dns_names: Vec<String>,
    pub uris: Vec<String>,
    /// The subject from its known attributes, as Go prints it (`ToRDNSequence().String()`).
    pub subject: String,
    /// `DC=` components in certificate order, appended to `subject` as one more candidate.
    pub domain_components: String,
    /// The subject as a DN (last RDN first), when every attribute is one the reference names.
    pub dn: Option<Dn>,
}

impl CertIdentity {
    pub fn of(c: &x509_parser::certificate::X509Certificate<'_>) -> CertIdentity {
        use x509_parser::extensions::GeneralName;
        let mut id = CertIdentity::default();
        if let Ok(Some(san)) = c.subject_alternative_name() {
            for n in &san.value.general_names {
                match n {
                    GeneralName::RFC822Name(e) => id.emails.push(e.to_string()),
                    GeneralName::DNSName(d) => id.dns_names.push(d.to_string()),
                    GeneralName::URI(u) => id.uris.push(u.to_string()),
                    _ => {}
                }
            }
        }
        let attrs = attributes(c.subject());
        let known: Vec<Vec<(String, String)>> = known_rdns(&attrs)
            .into_iter()
            .map(|r| {
                r.into_iter()
                    .map(|(t, v)| (t.to_string(), go_escape(&v)))
                    .collect()
            })
            .collect();
        id.subject = rdns_string(&known);
        const DC: &str = "0.9.2342.19200300.100.1.25";
        id.domain_components = attrs
            .iter()
            .flatten()
            .filter(|(o, v, _)| o == DC && v.is_some())
            .map(|(_, v, _)| format!("DC={}", v.as_deref().unwrap_or_default()))
            .collect::<Vec<_>>()
            .join(",");
        // The reference's DN of the raw subject: last RDN first, attributes reversed too;
        // none when an attribute has a type it does not name.
        let mut dn = vec![];
        let mut ok = true;
        for rdn in attrs.iter().rev().filter(|r| !r.is_empty()) {
            let mut r = vec![];
            for (oid, v, _) in rdn.iter().rev() {
                let t = if oid == DC {
                    Some("DC")
                } else {
                    go_type_name(oid)
                };
                match (t, v) {
                    (Some(t), Some(v)) => r.push((t.to_string(), v.clone())),
                    _ => ok = false,
                }
            }
            dn.push(r);
        }
        id.dn = ok.then_some(Dn(dn));
        id
    }

    /// The reference's order of trying a certificate's identities against the user names:
    /// email SANs, DNS SANs, URI SANs (each by exact name), the subject DN against user names
    /// written as DNs (same order, then any order), the subject with its domain components,
    /// then the subject alone. Returns the first user name that matches. This is the hook the
    /// authorization layer calls for `verify_and_map`.
    pub fn map_user<'a, I>(&self, users: I, log: &crate::log::Log) -> Option<&'a str>
    where
        I: IntoIterator<Item = &'a str>,
        I::IntoIter: Clone,
    {
        let users = users.into_iter();
        let exact = |cand: &str| users.clone().find(|u| *u == cand);
        for (what, list) in [
            ("email", &self.emails),
            ("SAN", &self.dns_names),
            ("URI", &self.uris),
        ] {
            for c in list {
                if let Some(u) = exact(c) {
                    crate::debug!(log, "Using {what} found in cert for auth [{u:?}]");
                    return Some(u);
                }
            }
        }
        if let Some(dn) = &self.dn {
            let parsed: Vec<(&'a str, Dn)> = users
                .clone()
                .filter_map(|u| Dn::parse(u).ok().map(|d| (u, d)))
                .collect();
            if let Some((u, _)) = parsed
                .iter()
                .find(|(_, d)| d.equal(dn))
                .or_else(|| parsed.iter().find(|(_, d)| d.rdns_match(dn)))
            {
                crate::debug!(log, "Using DistinguishedNameMatch for auth [{u:?}]");
                return Some(u);
            }
        }
        if !self.domain_components.is_empty() {
            let full = format!("{},{}", self.subject, self.domain_components);
            if let Some(u) = exact(&full) {
                crate::debug!(log, "Using RDNSequence for auth [{u:?}]");
                return Some(u);
            }
        }
        if let Some(u) = exact(&self.subject) {
            crate::debug!(log, "Using certificate subject for auth [{u:?}]");
            return Some(u);
        }
        crate::debug!(log, "User in cert [{:?}], not found", self.subject);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<TlsOpts, String> {
        let map = crate::conf::parse(&format!("tls {{ {text} }}")).unwrap();
        parse_block(map.get("tls").unwrap())
    }

    #[test]
    fn block_keys() {
        let t = parse("pinned_certs: [\"AB\"]");
        assert!(t.is_err(), "a 2-character pin is refused");
        let pin = "AB".repeat(32);
        let t = parse(&format!(
            "cert_file: c.pem, key_file: k.pem, verify_and_map: true, timeout: \"750ms\", \
             pinned_certs: [\"{pin}\"], min_version: \"1.3\", connection_rate_limit: 5, \
             cipher_suites: [\"TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256\", \"TLS_AES_128_GCM_SHA256\"], \
             curve_preferences: [\"X25519\", \"CurveP256\"], insecure: true"
        ))
        .unwrap();
        assert!(t.verify && t.map && t.insecure);
        assert_eq!(t.timeout(), Duration::from_millis(750));
        assert!(t.pinned.contains(&pin.to_ascii_lowercase()));
        assert_eq!(t.min_version, Some(ProtocolVersion::TLSv1_3));
        assert_eq!(t.rate_limit, 5);
        assert_eq!(
            parse("timeout: 3").unwrap().timeout(),
            Duration::from_secs(3)
        );
        assert_eq!(
            parse("timeout: 0.5").unwrap().timeout(),
            Duration::from_millis(500)
        );
        assert_eq!(parse("").unwrap().timeout(), DEFAULT_TIMEOUT);
        // verify_and_map: false does not turn verify off.
        let t = parse("verify: true, verify_and_map: false").unwrap();
        assert!(t.verify && !t.map);
    }

    #[test]
    fn handshake_first_forms() {
        for (v, first, fallback) in [
            ("true", true, None),
            ("\"on\"", true, None),
            ("false", false, None),
            ("\"off\"", false, None),
            ("\"auto\"", true, Some(DEFAULT_FALLBACK)),
            ("\"auto_fallback\"", true, Some(DEFAULT_FALLBACK)),
            ("\"300ms\"", true, Some(Duration::from_millis(300))),
        ] {
            let t = parse(&format!("handshake_first: {v}")).unwrap();
            assert_eq!((t.handshake_first, t.fallback), (first, fallback), "{v}");
        }
        let t = parse("first: true").unwrap();
        assert!(t.handshake_first);
        assert_eq!(
            parse("handshake_first: \"sometimes\"").unwrap_err(),
            "field \"handshake_first\"'s value \"sometimes\" is invalid"
        );
    }

    #[test]
    fn refused_keys_and_values() {
        for (text, want) in [
            ("bogus: 1", "error parsing tls config, unknown field \"bogus\""),
            ("verify: 1", "error parsing tls config, expected 'verify' to be a boolean"),
            ("cert_file: 1", "error parsing tls config, expected 'cert_file' to be filename"),
            ("cipher_suites: [\"NOPE\"]", "unrecognized cipher NOPE"),
            ("cipher_suites: []", "error parsing tls config, 'cipher_suites' cannot be empty"),
            (
                "cipher_suites: [\"TLS_RSA_WITH_AES_128_GCM_SHA256\"]",
                "insecure cipher suites configured without 'allow_insecure_cipher_suites' option set: TLS_RSA_WITH_AES_128_GCM_SHA256",
            ),
            ("curve_preferences: [\"CurveP999\"]", "unrecognized curve preference CurveP999"),
            ("min_version: \"1.1\"", "error parsing tls config: unsupported TLS version: TLS 1.1"),
            ("min_version: \"2\"", "error parsing tls config: unknown version: 2"),
            (
                "verify_cert_and_check_known_urls: true",
                "verify_cert_and_check_known_urls not supported in this context",
            ),
            (
                "cert_file: a, certs: [{cert_file: b, key_file: c}]",
                "error parsing tls config, cannot combine 'cert_file' option with 'certs' option",
            ),
        ] {
            assert_eq!(parse(text).unwrap_err(), want, "{text}");
        }
        // Valid for the reference, but nothing rustls can do: refused as not supported yet.
        for text in [
            "cipher_suites: [\"TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA\"]",
            "allow_insecure_cipher_suites: true, cipher_suites: [\"TLS_RSA_WITH_AES_128_GCM_SHA256\"]",
            "curve_preferences: [\"CurveP521\"]",
            "curve_preferences: [\"X25519MLKEM768\"]",
            "cert_store: WindowsCurrentUser",
            "ocsp_peer: true",
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains("does not support yet"), "{text}: {e}");
        }
        assert!(parse("verify_cert_and_check_known_urls: false").is_ok());
    }

    #[test]
    fn flags_keep_the_blocks_other_settings() {
        let base = parse("cert_file: a, key_file: b, timeout: 5, handshake_first: true").unwrap();
        let t = from_flags(Some(&base), Some("c".into()), Some("k".into()), None, true).unwrap();
        assert_eq!(t.cert_file, Some(PathBuf::from("c")));
        assert!(t.verify && t.handshake_first);
        assert_eq!(t.timeout(), Duration::from_secs(5));
        assert_eq!(
            from_flags(None, None, Some("k".into()), None, false).unwrap_err(),
            "TLS Server certificate must be present and valid"
        );
        assert_eq!(
            from_flags(None, Some("c".into()), None, None, false).unwrap_err(),
            "TLS Server private key must be present and valid"
        );
    }

    #[test]
    fn distinguished_names() {
        let d = Dn::parse("CN=alice, O=Acme\\, Inc.,OU=a+OU=b ,DC=example").unwrap();
        assert_eq!(
            d.0,
            vec![
                vec![("CN".into(), "alice".into())],
                vec![("O".into(), "Acme, Inc.".into())],
                vec![("OU".into(), "a".into()), ("OU".into(), "b".into())],
                vec![("DC".into(), "example".into())],
            ]
        );
        assert_eq!(Dn::parse("CN=\\41b").unwrap().0[0][0].1, "Ab");
        assert!(Dn::parse("alice").is_err());
        assert!(Dn::parse("CN=#0403").is_err());
        let other = Dn::parse("dc=example,OU=b+OU=a,O=Acme\\, Inc.,cn=alice").unwrap();
        assert!(!d.equal(&other) && d.rdns_match(&other));
        let same = Dn::parse("cn=alice,o=Acme\\, Inc.,ou=b+ou=a,dc=example").unwrap();
        assert!(d.equal(&same));
        assert!(!d.equal(&Dn::parse("CN=Alice,O=Acme\\, Inc.,OU=a+OU=b,DC=example").unwrap()));
    }

    fn cert(subject: &[(rcgen::DnType, &str)], sans: Vec<rcgen::SanType>) -> Vec<u8> {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        for (t, v) in subject {
            p.distinguished_name.push(t.clone(), *v);
        }
        p.subject_alt_names = sans;
        let key = rcgen::KeyPair::generate().unwrap();
        p.self_signed(&key).unwrap().der().to_vec()
    }

    const DC: [u64; 7] = [0, 9, 2342, 19200300, 100, 1, 25];
    const EMAIL_ATTR: [u64; 7] = [1, 2, 840, 113549, 1, 9, 1];

    #[test]
    fn identity_and_mapping_follow_the_reference() {
        use rcgen::{DnType, SanType};
        let der = cert(
            &[
                // (rcgen keeps one value per attribute type.)
                (DnType::CustomDnType(DC.to_vec()), "example"),
                (DnType::OrganizationName, "Acme, Inc."),
                (DnType::OrganizationalUnitName, "dev"),
                (DnType::CommonName, "alice"),
            ],
            vec![
                SanType::Rfc822Name("alice@example.org".try_into().unwrap()),
                SanType::DnsName("alice.example.org".try_into().unwrap()),
                SanType::URI("spiffe://example.org/alice".try_into().unwrap()),
            ],
        );
        let (_, c) = x509_parser::parse_x509_certificate(&der).unwrap();
        assert_eq!(
            go_subject(c.subject()),
            "CN=alice,OU=dev,O=Acme\\, Inc.,0.9.2342.19200300.100.1.25=example"
        );
        let id = CertIdentity::of(&c);
        assert_eq!(id.subject, "CN=alice,OU=dev,O=Acme\\, Inc.");
        assert_eq!(id.domain_components, "DC=example");
        let log = crate::log::Log::capture(crate::log::LogOpts::default());
        let map = |users: &[&'static str]| id.map_user(users.iter().copied(), &log);
        // The email SAN first, then DNS, then URI.
        let all = [
            "CN=alice,OU=dev,O=Acme\\, Inc.",
            "spiffe://example.org/alice",
            "alice.example.org",
            "alice@example.org",
        ];
        assert_eq!(map(&all), Some("alice@example.org"));
        assert_eq!(map(&all[..3]), Some("alice.example.org"));
        assert_eq!(map(&all[..2]), Some("spiffe://example.org/alice"));
        // The DN, in order or reordered, then the subject with its DCs, then alone.
        assert_eq!(
            map(&["CN=alice, OU=dev, O=Acme\\, Inc., DC=example"]),
            Some("CN=alice, OU=dev, O=Acme\\, Inc., DC=example")
        );
        assert_eq!(
            map(&["DC=example,O=Acme\\, Inc.,OU=dev,CN=alice"]),
            Some("DC=example,O=Acme\\, Inc.,OU=dev,CN=alice")
        );
        assert_eq!(map(&all[..1]), Some("CN=alice,OU=dev,O=Acme\\, Inc."));
        assert_eq!(map(&["bob", "CN=bob"]), None);
    }

    #[test]
    fn subject_with_attributes_the_reference_does_not_name() {
        use rcgen::DnType;
        let der = cert(
            &[
                (DnType::CountryName, "US"),
                (DnType::CommonName, " bob #1"),
                (DnType::CustomDnType(EMAIL_ATTR.to_vec()), "bob@example.org"),
            ],
            vec![],
        );
        let (_, c) = x509_parser::parse_x509_certificate(&der).unwrap();
        assert_eq!(
            go_subject(c.subject()),
            "CN=\\ bob #1,C=US,1.2.840.113549.1.9.1=bob@example.org"
        );
        let id = CertIdentity::of(&c);
        // An attribute without a DN name: no DN match, the subject string still maps.
        assert_eq!(id.dn, None);
        assert_eq!(
            id.map_user(
                ["CN=\\ bob #1,C=US"],
                &crate::log::Log::capture(crate::log::LogOpts::default())
            ),
            Some("CN=\\ bob #1,C=US")
        );
    }

    #[test]
    fn sni_names() {
        assert!(name_matches("*.example.org", "a.example.org"));
        assert!(!name_matches("*.example.org", "a.b.example.org"));
        assert!(name_matches("Localhost", "localhost."));
        assert!(!name_matches("localhost", "otherhost"));
    }

    #[test]
    fn rate_counter_counts_per_second() {
        let r = RateCounter::new(2);
        assert!(r.allow() && r.allow());
        assert!(!r.allow());
        assert_eq!(r.take_blocked(), 1);
        assert_eq!(r.take_blocked(), 0);
    }
}
