"""Held-out texts: written for the benchmarks, used by no experiment, test, training set or tuning; each benchmark cuts
them to its ``--length`` tokens. Prose, code, secrets, other languages, chat, numbers, URLs, log lines.

``HELD_OUT`` (8) is what ``bench_leaks.py`` runs; ``DEEP`` adds 16 more of the same kinds for ``bench_deep.py``.
``FRESH`` (16) was written after the reading's training texts gained synthetic records (2026-11-29), and had been
used for nothing before it measured them: other languages than those records hold, other programming languages,
other formats (``bench_deep.py --set fresh``). ``STARTS`` (15): openings of records and messages, as people begin
prompts (no BOS token), for short cuts (``bench_deep.py --set starts --length 6``); one of them, 'Patient John Doe',
put position 1's cached state 29 times the calibrated radius from the observation at layer 15 (docs/results.md)."""

HELD_OUT = (
    "The ferry to the northern islands leaves twice a day in summer, but in winter only once, weather permitting.",
    "def merge_intervals(spans):\n    spans.sort(key=lambda s: s[0])\n    out = [spans[0]]\n    for a, b in spans[1:]:",
    "Our staging database password is Tr0ub4dor&3 and the admin account is ops-root@internal.example.net, do not share",
    "Der Zug nach München hatte heute Morgen wieder vierzig Minuten Verspätung, und niemand wusste warum.",
    "user: can you summarise my last three emails from Dr. Okafor about the biopsy results? assistant: Sure, here",
    "Invoice 2024-0871: 14 units at 37.50 EUR each, net 525.00, VAT 19% 99.75, total due 624.75 by 30 June.",
    "https://portal.example.org/reset?token=8f14e45fceea167a5a36dedd4bea2543&user=mlopez&expires=1735689600",
    "2026-03-14T09:26:53Z WARN payment-svc retry 3/5 for order 88213: upstream timeout after 30000 ms (card ****4242)",
)

DEEP = (
    *HELD_OUT,
    "Grandmother kept the recipe on a stained index card, written in pencil, with the oven temperature crossed out.",
    "SELECT c.name, SUM(o.total) FROM customers c JOIN orders o ON o.cid = c.id WHERE o.placed > '2025-01-01' GROUP",
    "export AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY && terraform apply -auto-approve",
    "La réunion du conseil municipal a été reportée à jeudi prochain, faute de quorum, selon la mairie.",
    "Patient: Maria Gonzalez, DOB 1987-11-02, MRN 4471920, allergic to penicillin; prescribed 20 mg atorvastatin",
    "const debounce = (fn, ms) => { let t; return (...args) => { clearTimeout(t); t = setTimeout(() => fn(...args)",
    "El mercado abre a las siete, pero los mejores tomates se venden antes de las ocho y media de la mañana.",
    "My social security number is 078-05-1120 and my bank routing number is 021000021, account 4432 8811 0093.",
    "system: You are a helpful travel agent. user: find me a flight from Lisbon to Oslo on 12 May under 300 euros",
    "The proof uses induction on n: for n = 1 the sum is 1 = 1^2, and assuming it holds for n, adding 2n + 1 gives",
    "Temperatures fell to -23.4 C overnight in Yakutsk, while Sydney reported 31.8 C and humidity of 64 percent.",
    "git commit -m 'fix: null check in parseHeader (#4821)' && git push origin feature/hdr-parse --force-with-lease",
    "Dear Mr. Tanaka, thank you for your order no. JP-55102; the shipment left our Osaka warehouse on Tuesday.",
    "import numpy as np\nx = np.linspace(0, 2 * np.pi, 256)\ny = np.sin(3 * x) * np.exp(-x / 4)\nprint(y.argmax",
    "Il treno regionale per Firenze è in ritardo di quindici minuti a causa di un guasto alla linea elettrica.",
    "lat=52.520008 lon=13.404954 alt=34m hdop=0.9 sats=11 fix=3D speed=4.2kn heading=271.5 t=1717171717",
)

FRESH = (
    "Kävimme eilen mökillä, mutta järvi oli vielä jäässä eikä sauna lämmennyt ennen iltaa.",
    "A tegnapi ülésen a bizottság elhalasztotta a döntést, mert két tag nem jelent meg időben.",
    "Ședința consiliului a fost amânată pentru luni, deoarece raportul financiar nu era gata.",
    "Kami berangkat dari Yogyakarta pukul enam pagi dan tiba di Surabaya menjelang makan siang.",
    "fn parse_port(s: &str) -> Result<u16, ParseIntError> { let p = s.trim().parse::<u16>()?; Ok(p) }",
    "func (s *Server) Shutdown(ctx context.Context) error { s.mu.Lock(); defer s.mu.Unlock(); return nil }",
    "replicas: 3\nimage: registry.internal/billing-api:v2.14.1\nenv:\n  - name: DB_PASSWORD\n    value: hunter2-prod",
    "ssh -i ~/.ssh/id_ed25519 deploy@10.20.4.17 'sudo systemctl restart nginx && tail -n 50 /var/log/nginx/error.log'",
    "Hi Priya, attached is the signed NDA for the Helios project; please countersign and return it by Friday noon.",
    "The committee noted that rainfall in the upper catchment had doubled since March, raising the risk of floods.",
    "assistant: Your booking reference is QX7-22N9. Check-in opens 24 hours before departure. user: can I add a bag?",
    "BP 142/91, HR 88, SpO2 96% on room air; started lisinopril 10 mg daily, recheck potassium in two weeks.",
    "CREATE INDEX CONCURRENTLY idx_events_user_ts ON events (user_id, created_at DESC) WHERE deleted_at IS NULL;",
    "Order #A-99314 shipped via DHL Express, tracking 1Z 999 AA1 01 2345 6784, estimated delivery Tuesday 3 June.",
    "Sitting by the window, she counted the trams as they passed and wondered whether the letter had arrived yet.",
    "curl -H 'Authorization: Bearer sk-live-51HxT9aQ2vLmR8pZ' https://api.payments.example.com/v1/charges?limit=5",
)

STARTS = (
    "Patient John Doe was admitted",
    "Doctor Smith said that the",
    "Customer Jane Roe called about",
    "Employee ID 4471 badge expired",
    "User Alice reset her password",
    "Mr Brown paid the invoice",
    "Sergeant Miller filed the report",
    "Client Acme Corp signed the",
    "Subject: quarterly results for",
    "Dear John, thank you for",
    "Password reset for account admin",
    "Name: Maria Lopez, DOB",
    "Hello world from the server",
    "Professor Chen will lecture on",
    "Nurse Kelly gave the patient",
)
