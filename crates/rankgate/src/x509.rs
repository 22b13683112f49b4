//! The one fact rankgate reads out of a certificate itself: when it stops being valid
//! (`notAfter`), for the expiry warning and `rankgate_tls_cert_expiry_timestamp_seconds`.
//!
//! A short walk over the DER (RFC 5280 `Certificate` → `tbsCertificate` → `validity`) rather
//! than an X.509 crate: rustls checks everything else, and a parser crate for one date would
//! cost more to build than the walk costs to read. Outside bytes: every length is checked
//! against what is left, and anything unexpected is `None`, never a panic.

/// One DER element: its tag, its contents and what follows it.
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = match first {
        0..=0x7f => (first as usize, rest),
        // Long form: 1 to 4 length bytes (a certificate is far below 4 GiB).
        0x81..=0x84 => {
            let n = (first & 0x7f) as usize;
            let (bytes, rest) = (rest.get(..n)?, rest.get(n..)?);
            (
                bytes.iter().fold(0usize, |l, &b| (l << 8) | b as usize),
                rest,
            )
        }
        _ => return None,
    };
    Some((tag, rest.get(..len)?, rest.get(len..)?))
}

const SEQUENCE: u8 = 0x30;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;
/// `[0] EXPLICIT Version`, present from v2 on.
const VERSION: u8 = 0xa0;

/// The certificate's `notAfter`, in seconds since the Unix epoch.
pub fn not_after(der: &[u8]) -> Option<i64> {
    let (SEQUENCE, cert, _) = element(der)? else {
        return None;
    };
    let (SEQUENCE, tbs, _) = element(cert)? else {
        return None;
    };
    let mut rest = tbs;
    if rest.first() == Some(&VERSION) {
        rest = element(rest)?.2;
    }
    // serialNumber, signature, issuer.
    for _ in 0..3 {
        rest = element(rest)?.2;
    }
    let (SEQUENCE, validity, _) = element(rest)? else {
        return None;
    };
    // notBefore, then notAfter.
    let (_, _, after) = element(validity)?;
    let (tag, time, _) = element(after)?;
    time_of(tag, time)
}

/// `YYMMDDHHMMSSZ` (UTCTime: 1950-2049) or `YYYYMMDDHHMMSSZ` (GeneralizedTime), as RFC 5280
/// requires them (UTC, whole seconds).
fn time_of(tag: u8, text: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(text).ok()?.strip_suffix('Z')?;
    if !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (year, rest) = match (tag, text.len()) {
        (UTC_TIME, 12) => {
            let yy: i64 = text[..2].parse().ok()?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &text[2..])
        }
        (GENERALIZED_TIME, 14) => (text[..4].parse().ok()?, &text[4..]),
        _ => return None,
    };
    let n = |i: usize| -> Option<i64> { rest.get(i..i + 2)?.parse().ok() };
    let (month, day, h, m, s) = (n(0)?, n(2)?, n(4)?, n(6)?, n(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || h > 23 || m > 59 || s > 60 {
        return None;
    }
    Some(days_from_civil(year, month, day) * 86_400 + h * 3600 + m * 60 + s)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The civil date (year, month, day) of a day count since 1970-01-01, by Howard Hinnant's
/// `civil_from_days`.
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `YYYY-MM-DD HH:MM:SS UTC` of seconds since the epoch.
pub fn utc_text(secs: i64) -> String {
    let (days, t) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        t / 3600,
        t / 60 % 60,
        t % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(utc_text(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc_text(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(time_of(UTC_TIME, b"491231235959Z"), Some(2_524_607_999));
        assert_eq!(time_of(UTC_TIME, b"500101000000Z"), Some(-631_152_000));
        assert_eq!(
            time_of(GENERALIZED_TIME, b"20500101000000Z"),
            Some(2_524_608_000)
        );
        assert_eq!(time_of(UTC_TIME, b"501301000000Z"), None);
        assert_eq!(time_of(UTC_TIME, b"5001010000+0Z"), None);
        assert_eq!(time_of(GENERALIZED_TIME, b"500101000000Z"), None);
    }

    #[test]
    fn not_after_of_a_generated_certificate() {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
        params.not_after = rcgen::date_time_ymd(2031, 7, 9);
        let key = rcgen::KeyPair::generate().unwrap();
        let der = params.self_signed(&key).unwrap().der().to_vec();
        let at = not_after(&der).unwrap();
        assert_eq!(utc_text(at), "2031-07-09 00:00:00 UTC");
        // Cut anywhere, or with a byte changed, it is `None` or a date, never a panic.
        for n in 0..der.len() {
            let _ = not_after(&der[..n]);
            let mut bent = der.clone();
            bent[n] ^= 0x80;
            let _ = not_after(&bent);
        }
        assert_eq!(not_after(b""), None);
        assert_eq!(not_after(&[0x30, 0x85, 1, 1, 1, 1, 1]), None);
    }
}
