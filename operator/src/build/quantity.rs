//! Kubernetes quantities (`500m`, `2Gi`, `1e3`) as numbers: the build step compares a limit
//! with its request, and turns `kvCacheMemory` into bytes, before the apiserver or the kubelet
//! would refuse the pod where nobody looks (a ReplicaSet's events).

/// The value of a quantity in base units (cores, bytes), or `None` when it is not one.
pub fn value(q: &str) -> Option<f64> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(q.len());
    let (num, suffix) = q.split_at(split);
    if num.is_empty() || num.starts_with('-') {
        return None;
    }
    let num: f64 = num.parse().ok()?;
    let mult = match suffix {
        "" => 1.0,
        "n" => 1e-9,
        "u" => 1e-6,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024f64,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        e if e.starts_with(['e', 'E']) => 10f64.powi(e[1..].parse::<i32>().ok()?),
        _ => return None,
    };
    let v = num * mult;
    v.is_finite().then_some(v)
}

/// A byte quantity (`2Gi`, `512Mi`, `1G`, `1024`) as whole bytes; at least one.
pub fn bytes(q: &str) -> Option<u64> {
    value(q).filter(|b| *b >= 1.0).map(|b| b as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_decimal_binary_and_exponents() {
        let cases = [
            ("500m", 0.5),
            ("2", 2.0),
            ("1.5", 1.5),
            ("2Gi", 2.0 * 1024f64.powi(3)),
            ("512Mi", 512.0 * 1024f64.powi(2)),
            ("1G", 1e9),
            ("1e3", 1000.0),
            ("100k", 1e5),
            ("0", 0.0),
        ];
        for (q, want) in cases {
            assert_eq!(value(q), Some(want), "{q}");
        }
        for bad in ["", "Gi", "-1", "1.2.3", "1Xi", "1e", "one"] {
            assert_eq!(value(bad), None, "{bad}");
        }
    }

    #[test]
    fn bytes_need_at_least_one() {
        assert_eq!(bytes("2Gi"), Some(2 << 30));
        assert_eq!(bytes("1024"), Some(1024));
        assert_eq!(bytes("0"), None);
        assert_eq!(bytes("0.5"), None);
        assert_eq!(bytes("500m"), None);
    }
}
