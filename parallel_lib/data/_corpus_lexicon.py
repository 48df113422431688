"""The German/English word lists behind the offline corpus (data only; grammar in ``_corpus``).

Kept as compact ``|``-separated tables so a reader can check a word and its translation
on one line. Tags say which words fit together (``essen`` takes ``food``, ``tragen``
with ``wear`` means "wear" but with ``carry`` means "carry"), so generated sentences
make sense instead of being random word salad.
"""

__all__: list[str] = []

# gender | singular | plural ("-": mass noun, no article "ein") | English singular | English plural | tags
# tags: the category first; "weak": n-declension (den Jungen); "he"/"she": English pronoun of a person;
# places add "@<German location preposition>:<English one>" and "><German direction preposition>".
NOUNS = """
m|Mann|Männer|man|men|person he
f|Frau|Frauen|woman|women|person she
n|Kind|Kinder|child|children|person it
m|Junge|Jungen|boy|boys|person he weak
n|Mädchen|Mädchen|girl|girls|person she
m|Vater|Väter|father|fathers|person he
f|Mutter|Mütter|mother|mothers|person she
m|Bruder|Brüder|brother|brothers|person he
f|Schwester|Schwestern|sister|sisters|person she
m|Sohn|Söhne|son|sons|person he
f|Tochter|Töchter|daughter|daughters|person she
m|Freund|Freunde|friend|friends|person he
f|Freundin|Freundinnen|friend|friends|person she
m|Lehrer|Lehrer|teacher|teachers|person he
f|Lehrerin|Lehrerinnen|teacher|teachers|person she
m|Arzt|Ärzte|doctor|doctors|person he
f|Ärztin|Ärztinnen|doctor|doctors|person she
m|Student|Studenten|student|students|person he weak
f|Studentin|Studentinnen|student|students|person she
m|Koch|Köche|cook|cooks|person he
f|Köchin|Köchinnen|cook|cooks|person she
m|Bäcker|Bäcker|baker|bakers|person he
m|Nachbar|Nachbarn|neighbor|neighbors|person he weak
f|Nachbarin|Nachbarinnen|neighbor|neighbors|person she
m|Polizist|Polizisten|police officer|police officers|person he weak
m|Verkäufer|Verkäufer|salesman|salesmen|person he
f|Verkäuferin|Verkäuferinnen|saleswoman|saleswomen|person she
m|Kellner|Kellner|waiter|waiters|person he
f|Kellnerin|Kellnerinnen|waitress|waitresses|person she
m|Fahrer|Fahrer|driver|drivers|person he
m|Großvater|Großväter|grandfather|grandfathers|person he
f|Großmutter|Großmütter|grandmother|grandmothers|person she
m|Onkel|Onkel|uncle|uncles|person he
f|Tante|Tanten|aunt|aunts|person she
n|Baby|Babys|baby|babies|person it cute
m|Chef|Chefs|boss|bosses|person he
f|Chefin|Chefinnen|boss|bosses|person she
m|Gast|Gäste|guest|guests|person he
m|Kunde|Kunden|customer|customers|person he weak
f|Kundin|Kundinnen|customer|customers|person she
m|Bauer|Bauern|farmer|farmers|person he weak
m|Künstler|Künstler|artist|artists|person he
f|Künstlerin|Künstlerinnen|artist|artists|person she
m|Musiker|Musiker|musician|musicians|person he
m|Schüler|Schüler|pupil|pupils|person he
f|Schülerin|Schülerinnen|pupil|pupils|person she
m|Tourist|Touristen|tourist|tourists|person he weak
m|Ingenieur|Ingenieure|engineer|engineers|person he
f|Ingenieurin|Ingenieurinnen|engineer|engineers|person she
m|Pilot|Piloten|pilot|pilots|person he weak
m|König|Könige|king|kings|person he
f|Königin|Königinnen|queen|queens|person she
m|Hund|Hunde|dog|dogs|animal pet fur swimmer cute
f|Katze|Katzen|cat|cats|animal pet fur cute
n|Pferd|Pferde|horse|horses|animal farm fur
m|Vogel|Vögel|bird|birds|animal pet flyer prey cute
f|Maus|Mäuse|mouse|mice|animal pet prey cute
f|Kuh|Kühe|cow|cows|animal farm fur
n|Schwein|Schweine|pig|pigs|animal farm
n|Schaf|Schafe|sheep|sheep|animal farm fur cute
m|Fisch|Fische|fish|fish|animal pet swimmer prey
m|Bär|Bären|bear|bears|animal wild fur swimmer weak
m|Löwe|Löwen|lion|lions|animal wild weak
m|Elefant|Elefanten|elephant|elephants|animal wild swimmer weak
m|Affe|Affen|monkey|monkeys|animal wild cute weak
f|Ente|Enten|duck|ducks|animal farm swimmer flyer cute
n|Huhn|Hühner|chicken|chickens|animal farm
n|Kaninchen|Kaninchen|rabbit|rabbits|animal pet fur prey cute
m|Fuchs|Füchse|fox|foxes|animal wild fur
m|Wolf|Wölfe|wolf|wolves|animal wild fur
f|Ziege|Ziegen|goat|goats|animal farm fur
m|Esel|Esel|donkey|donkeys|animal farm fur
f|Schlange|Schlangen|snake|snakes|animal wild
m|Tiger|Tiger|tiger|tigers|animal wild
f|Eule|Eulen|owl|owls|animal wild flyer
m|Apfel|Äpfel|apple|apples|food fruit animalfood
f|Banane|Bananen|banana|bananas|food fruit animalfood
f|Orange|Orangen|orange|oranges|food fruit
f|Birne|Birnen|pear|pears|food fruit
f|Zitrone|Zitronen|lemon|lemons|food
f|Erdbeere|Erdbeeren|strawberry|strawberries|food fruit
f|Kirsche|Kirschen|cherry|cherries|food fruit
f|Tomate|Tomaten|tomato|tomatoes|food
f|Kartoffel|Kartoffeln|potato|potatoes|food cook
f|Karotte|Karotten|carrot|carrots|food animalfood
f|Zwiebel|Zwiebeln|onion|onions|food
m|Salat|Salate|salad|salads|food
n|Ei|Eier|egg|eggs|food cook
m|Kuchen|Kuchen|cake|cakes|food bake sweet gift
n|Brot|-|bread|-|food bake
n|Brötchen|Brötchen|bread roll|bread rolls|food bake
m|Keks|Kekse|cookie|cookies|food bake sweet
f|Pizza|Pizzas|pizza|pizzas|food bake cooked
f|Suppe|Suppen|soup|soups|food cook cooked
f|Wurst|Würste|sausage|sausages|food animalfood
m|Käse|-|cheese|-|food
m|Reis|-|rice|-|food cook cooked
n|Fleisch|-|meat|-|food cook cooked animalfood
f|Schokolade|-|chocolate|-|food sweet gift
n|Eis|-|ice cream|-|food sweet
m|Honig|-|honey|-|food sweet
m|Knochen|Knochen|bone|bones|animalfood
n|Gras|-|grass|-|animalfood
n|Wasser|-|water|-|drink
f|Milch|-|milk|-|drink
m|Kaffee|-|coffee|-|drink
m|Tee|-|tea|-|drink
m|Saft|-|juice|-|drink sweet
n|Bier|-|beer|-|drink
m|Wein|-|wine|-|drink
f|Limonade|-|lemonade|-|drink sweet
m|Kakao|-|cocoa|-|drink sweet
n|Buch|Bücher|book|books|object read gift carry show
f|Zeitung|Zeitungen|newspaper|newspapers|object read
m|Brief|Briefe|letter|letters|object read write send open
f|Zeitschrift|Zeitschriften|magazine|magazines|object read
f|Geschichte|Geschichten|story|stories|read write tell
f|E-Mail|E-Mails|email|emails|read write send
f|Postkarte|Postkarten|postcard|postcards|object read write send
n|Heft|Hefte|notebook|notebooks|object carry
m|Stift|Stifte|pen|pens|object lose
m|Bleistift|Bleistifte|pencil|pencils|object lose
m|Schlüssel|Schlüssel|key|keys|object lose
f|Tasche|Taschen|bag|bags|object container carry lose colored gift
m|Koffer|Koffer|suitcase|suitcases|object container carry open colored
m|Rucksack|Rucksäcke|backpack|backpacks|object container carry lose colored
f|Uhr|Uhren|watch|watches|object lose fix gift
n|Handy|Handys|phone|phones|object lose fix
m|Computer|Computer|computer|computers|object fix
f|Lampe|Lampen|lamp|lamps|object fix lamp colored
m|Tisch|Tische|table|tables|object furniture fix clean
m|Stuhl|Stühle|chair|chairs|object furniture fix
n|Bett|Betten|bed|beds|object furniture
n|Sofa|Sofas|sofa|sofas|object furniture colored
m|Schrank|Schränke|cupboard|cupboards|object furniture container open
f|Kiste|Kisten|box|boxes|object container carry open
f|Tür|Türen|door|doors|open landmark colored clean
n|Fenster|Fenster|window|windows|open landmark clean
m|Ball|Bälle|ball|balls|object catch gift colored
n|Bild|Bilder|picture|pictures|object gift show paint
n|Foto|Fotos|photo|photos|object show send
n|Geschenk|Geschenke|present|presents|object gift carry send
f|Blume|Blumen|flower|flowers|plant gift colored paint
m|Baum|Bäume|tree|trees|plant landmark paint
m|Hut|Hüte|hat|hats|object wear clothes colored gift
m|Mantel|Mäntel|coat|coats|object wear clothes colored
f|Jacke|Jacken|jacket|jackets|object wear clothes colored
n|Kleid|Kleider|dress|dresses|object wear clothes colored gift
m|Schuh|Schuhe|shoe|shoes|object wear clothes colored clean
n|Hemd|Hemden|shirt|shirts|object wear clothes colored
m|Pullover|Pullover|sweater|sweaters|object wear clothes colored gift
m|Teller|Teller|plate|plates|object dish
f|Tasse|Tassen|cup|cups|object dish container
n|Glas|Gläser|glass|glasses|object dish container
f|Flasche|Flaschen|bottle|bottles|object dish container
n|Messer|Messer|knife|knives|object dish
f|Gabel|Gabeln|fork|forks|object dish
m|Löffel|Löffel|spoon|spoons|object dish
m|Regenschirm|Regenschirme|umbrella|umbrellas|object lose colored carry
f|Fahrkarte|Fahrkarten|ticket|tickets|object lose
n|Lied|Lieder|song|songs|hear write
n|Spiel|Spiele|game|games|object game gift
f|Gitarre|Gitarren|guitar|guitars|object game
n|Klavier|Klaviere|piano|pianos|object game
n|Radio|Radios|radio|radios|object fix hear
m|Fernseher|Fernseher|television|televisions|object fix
n|Paket|Pakete|package|packages|object send carry pickup
n|Geld|-|money|-|need lose gift
f|Musik|-|music|-|hear
f|Kerze|Kerzen|candle|candles|object gift
m|Spiegel|Spiegel|mirror|mirrors|object clean
f|Stadt|Städte|city|cities|place live visit dest loud @in:in >in
n|Dorf|Dörfer|village|villages|place live visit dest @in:in >in
n|Haus|Häuser|house|houses|place live building build dest landmark paint @in:in >in
f|Wohnung|Wohnungen|apartment|apartments|place live tidy room clean @in:in >in
f|Schule|Schulen|school|schools|place work study building dest @in:at >zu
m|Park|Parks|park|parks|place outdoor play sit dest @in:in >in
m|Garten|Gärten|garden|gardens|place outdoor play sit work dest @in:in >in
f|Küche|Küchen|kitchen|kitchens|place room eat tidy clean work @in:in >in
n|Zimmer|Zimmer|room|rooms|place room tidy clean @in:in >in
n|Büro|Büros|office|offices|place work room tidy dest @in:in >in
m|Bahnhof|Bahnhöfe|station|stations|place wait dest building landmark arrive loud @an:at >zu
m|Flughafen|Flughäfen|airport|airports|place wait dest building work arrive @an:at >zu
n|Restaurant|Restaurants|restaurant|restaurants|place eat work dest eatery building @in:in >in
n|Café|Cafés|café|cafés|place eat sit wait dest eatery @in:in >in
f|Bibliothek|Bibliotheken|library|libraries|place study work dest building visit @in:in >in
n|Krankenhaus|Krankenhäuser|hospital|hospitals|place work dest building @in:in >in
m|Markt|Märkte|market|markets|place shop dest loud @auf:at >auf
m|Supermarkt|Supermärkte|supermarket|supermarkets|place shop work dest building @in:in >in
n|Museum|Museen|museum|museums|place visit dest building @in:in >in
f|Kirche|Kirchen|church|churches|place visit sing building landmark @in:in >in
f|Bank|Banken|bank|banks|place work dest building @in:at >zu
f|Straße|Straßen|street|streets|place outdoor play long loud @auf:on >auf
m|Wald|Wälder|forest|forests|place outdoor dest @in:in >in
m|Berg|Berge|mountain|mountains|place dest tall @auf:on >auf
m|See|Seen|lake|lakes|place water dest sit @an:at >an
n|Meer|Meere|sea|seas|place water dest sit @an:by >an
m|Fluss|Flüsse|river|rivers|place water long sit @an:by >an
m|Strand|Strände|beach|beaches|place outdoor play sit dest @an:on >an
n|Hotel|Hotels|hotel|hotels|place wait work building dest arrive @in:in >in
n|Kino|Kinos|cinema|cinemas|place dest building @in:at >in
n|Theater|Theater|theater|theaters|place dest building sing visit @in:at >in
m|Zoo|Zoos|zoo|zoos|place visit dest @in:at >in
f|Universität|Universitäten|university|universities|place study work dest building @an:at >zu
f|Brücke|Brücken|bridge|bridges|place build long landmark @auf:on >zu
m|Turm|Türme|tower|towers|place build tall landmark visit @auf:on >auf
n|Schloss|Schlösser|castle|castles|place build visit dest building landmark @in:in >zu
m|Bauernhof|Bauernhöfe|farm|farms|place live work dest @auf:on >zu
f|Insel|Inseln|island|islands|place live dest visit @auf:on >auf
m|Spielplatz|Spielplätze|playground|playgrounds|place outdoor play dest @auf:at >zu
n|Auto|Autos|car|cars|vehicle drive colored clean fix landmark transport
m|Bus|Busse|bus|buses|vehicle drive public transport
m|Zug|Züge|train|trains|vehicle public long transport
n|Fahrrad|Fahrräder|bicycle|bicycles|vehicle ride colored fix transport
n|Motorrad|Motorräder|motorcycle|motorcycles|vehicle ride colored fix transport
n|Boot|Boote|boat|boats|vehicle build colored
n|Schiff|Schiffe|ship|ships|vehicle transport
n|Flugzeug|Flugzeuge|plane|planes|vehicle transport
n|Taxi|Taxis|taxi|taxis|vehicle drive public transport
f|Straßenbahn|Straßenbahnen|tram|trams|vehicle public transport
m|Lastwagen|Lastwagen|truck|trucks|vehicle drive
"""

# predicative[/attributive stem] | English | comparative | English comparative ("-": none) | noun tags it fits
ADJECTIVES = """
groß|big|größer|bigger|person animal object place vehicle plant landmark
klein|small|kleiner|smaller|person animal object place vehicle plant landmark
alt|old|älter|older|person animal object place vehicle plant
jung|young|jünger|younger|person animal
neu|new|neuer|newer|object vehicle building clothes
schön|beautiful|schöner|more beautiful|person animal object place plant hear
hässlich|ugly|hässlicher|uglier|animal object building clothes
rot|red|-|-|colored
blau|blue|-|-|colored
grün|green|-|-|colored
gelb|yellow|-|-|colored
schwarz|black|-|-|colored fur
weiß|white|-|-|colored fur
braun|brown|-|-|colored fur
schnell|fast|schneller|faster|animal vehicle person
langsam|slow|langsamer|slower|animal vehicle person
müde|tired|müder|more tired|person animal
hungrig|hungry|hungriger|hungrier|person animal
durstig|thirsty|durstiger|thirstier|person animal
krank|sick|kränker|sicker|person animal
glücklich|happy|glücklicher|happier|person
traurig|sad|trauriger|sadder|person
freundlich|friendly|freundlicher|friendlier|person animal
nett|nice|netter|nicer|person
lustig|funny|lustiger|funnier|person animal
klug|clever|klüger|cleverer|person animal
stark|strong|stärker|stronger|person animal
faul|lazy|fauler|lazier|person animal
reich|rich|reicher|richer|person
gesund|healthy|gesünder|healthier|person animal food
teuer/teur|expensive|teurer|more expensive|object vehicle food
billig|cheap|billiger|cheaper|object vehicle food
frisch|fresh|frischer|fresher|food drink animalfood
süß|sweet|süßer|sweeter|sweet fruit
süß|cute|süßer|cuter|cute
lecker|delicious|leckerer|more delicious|food
heiß|hot|heißer|hotter|drink cooked
kalt|cold|kälter|colder|drink cooked water
warm|warm|wärmer|warmer|drink cooked clothes water
leer|empty|leerer|emptier|container eatery
voll|full|voller|fuller|container public eatery
sauber|clean|sauberer|cleaner|object place vehicle
schmutzig|dirty|schmutziger|dirtier|object place vehicle animal
laut|loud|lauter|louder|person animal loud vehicle hear
leise|quiet|leiser|quieter|person animal
interessant|interesting|interessanter|more interesting|read visit person
langweilig|boring|langweiliger|more boring|read visit person
berühmt|famous|berühmter|more famous|person visit
dunkel/dunkl|dark|dunkler|darker|room clothes
hell|bright|heller|brighter|room lamp
schwer|heavy|schwerer|heavier|carry
leicht|light|leichter|lighter|carry
lang|long|länger|longer|read long clothes
kurz|short|kürzer|shorter|read long clothes
hoch/hoh|high|höher|higher|tall
gefährlich|dangerous|gefährlicher|more dangerous|wild
bequem|comfortable|bequemer|more comfortable|furniture clothes
modern|modern|moderner|more modern|building vehicle
gemütlich|cozy|gemütlicher|cozier|room eatery
"""

# infinitive | du/er stem with vowel change ("-": none) | participle | auxiliary | English | English past |
# subject tags | frame: "acc:<tags>", "dat:<tags>", "place:<tags>" ("place!": required), "dir" (direction,
# "dir:city": cities only), "transport", "with", "manner", "sep:<separable prefix>"
VERBS = """
essen|iss|gegessen|haben|eat|ate|person|acc:food place:eat manner
fressen|friss|gefressen|haben|eat|ate|animal|acc:animalfood,prey place:outdoor
trinken|-|getrunken|haben|drink|drank|person animal|acc:drink place:eat manner
kaufen|-|gekauft|haben|buy|bought|person|acc:food,drink,object,vehicle place:shop
verkaufen|-|verkauft|haben|sell|sold|person|acc:food,object,vehicle place:shop
sehen|sieh|gesehen|haben|see|saw|person animal|acc:person,animal,object,vehicle,plant,landmark
lesen|lies|gelesen|haben|read|read|person|acc:read place:study,sit,room manner
schreiben|-|geschrieben|haben|write|wrote|person|acc:write place:study,room manner
suchen|-|gesucht|haben|look for|looked for|person animal|acc:person,animal,lose
finden|-|gefunden|haben|find|found|person animal|acc:person,animal,lose
brauchen|-|gebraucht|haben|need|needed|person|acc:object,food,drink,vehicle,need
mögen|-|gemocht|haben|like|liked|person|acc:person,animal,food,drink,clothes,read,hear
lieben|-|geliebt|haben|love|loved|person|acc:person,animal,food,hear
öffnen|-|geöffnet|haben|open|opened|person|acc:open manner
schließen|-|geschlossen|haben|close|closed|person|acc:open manner
tragen|träg|getragen|haben|carry|carried|person|acc:carry
tragen|träg|getragen|haben|wear|wore|person|acc:wear
waschen|wäsch|gewaschen|haben|wash|washed|person|acc:dish,clothes,pet place:room manner
malen|-|gemalt|haben|paint|painted|person|acc:paint,animal,person place:room,outdoor manner
zeichnen|-|gezeichnet|haben|draw|drew|person|acc:animal,person,plant,building,vehicle manner
bauen|-|gebaut|haben|build|built|person|acc:build manner
besuchen|-|besucht|haben|visit|visited|person|acc:person,visit
kennen|-|gekannt|haben|know|knew|person|acc:person,visit
treffen|triff|getroffen|haben|meet|met|person|acc:person place:eat,outdoor,wait
fragen|-|gefragt|haben|ask|asked|person|acc:person
rufen|-|gerufen|haben|call|called|person|acc:person,pet
hören|-|gehört|haben|hear|heard|person animal|acc:hear,person,animal
spielen|-|gespielt|haben|play|played|person|acc:game place:room manner
kochen|-|gekocht|haben|cook|cooked|person|acc:cook place:eat manner
backen|-|gebacken|haben|bake|baked|person|acc:bake place:eat
bestellen|-|bestellt|haben|order|ordered|person|acc:food,drink place:eatery
nehmen|nimm|genommen|haben|take|took|person|acc:object,food,public
holen|-|geholt|haben|fetch|fetched|person|acc:object,drink,food
vergessen|vergiss|vergessen|haben|forget|forgot|person|acc:lose
verlieren|-|verloren|haben|lose|lost|person|acc:lose
reparieren|-|repariert|haben|repair|repaired|person|acc:fix manner
putzen|-|geputzt|haben|clean|cleaned|person|acc:clean manner
fahren|fähr|gefahren|haben|drive|drove|person|acc:drive manner
fahren|fähr|gefahren|haben|ride|rode|person|acc:ride manner
fangen|fäng|gefangen|haben|catch|caught|person animal|acc:prey,catch
füttern|-|gefüttert|haben|feed|fed|person|acc:animal
haben|-|-|haben|have|had|person|acc:pet,object,vehicle
anrufen|-|angerufen|haben|call|called|person|acc:person sep:an
abholen|-|abgeholt|haben|pick up|picked up|person|acc:person,pickup sep:ab
aufräumen|-|aufgeräumt|haben|tidy up|tidied up|person|acc:tidy sep:auf manner
einladen|läd|eingeladen|haben|invite|invited|person|acc:person sep:ein
anschauen|-|angeschaut|haben|look at|looked at|person|acc:person,animal,paint,show,landmark sep:an
geben|gib|gegeben|haben|give|gave|person|dat:person acc:gift,food
schenken|-|geschenkt|haben|give|gave|person|dat:person acc:gift
zeigen|-|gezeigt|haben|show|showed|person|dat:person acc:show,read
bringen|-|gebracht|haben|bring|brought|person|dat:person acc:food,drink,gift,read
schicken|-|geschickt|haben|send|sent|person|dat:person acc:send
erzählen|-|erzählt|haben|tell|told|person|dat:person acc:tell
helfen|hilf|geholfen|haben|help|helped|person|dat:person place:work,room
danken|-|gedankt|haben|thank|thanked|person|dat:person
antworten|-|geantwortet|haben|answer|answered|person|dat:person manner
folgen|-|gefolgt|sein|follow|followed|person animal|dat:person,animal
gehören|-|gehört|haben|belong to|belonged to|object|dat:person
schlafen|schläf|geschlafen|haben|sleep|slept|person animal|place:room,outdoor,live
arbeiten|-|gearbeitet|haben|work|worked|person|place:work with manner
lachen|-|gelacht|haben|laugh|laughed|person|manner
weinen|-|geweint|haben|cry|cried|person|manner
singen|-|gesungen|haben|sing|sang|person|place:sing,room,outdoor with manner
tanzen|-|getanzt|haben|dance|danced|person|place:room,outdoor,eatery with manner
warten|-|gewartet|haben|wait|waited|person|place:wait with
spielen|-|gespielt|haben|play|played|person animal|place:play,room with
schwimmen|-|geschwommen|sein|swim|swam|person swimmer|place:water with manner
laufen|läuf|gelaufen|sein|run|ran|person animal|place:outdoor dir manner
gehen|-|gegangen|sein|go|went|person|dir with
kommen|-|gekommen|sein|come|came|person|dir transport with
fahren|fähr|gefahren|sein|go|went|person|dir transport with
fliegen|-|geflogen|sein|fly|flew|person|dir:city
fliegen|-|geflogen|sein|fly|flew|flyer|place:outdoor
reisen|-|gereist|sein|travel|traveled|person|dir:city transport with
wohnen|-|gewohnt|haben|live|lived|person|place!:live
bleiben|-|geblieben|sein|stay|stayed|person|place!:live,eat
sitzen|-|gesessen|haben|sit|sat|person animal|place!:sit
lernen|-|gelernt|haben|study|studied|person|place:study with
einkaufen|-|eingekauft|haben|shop|shopped|person|place:shop with sep:ein
aufstehen|-|aufgestanden|sein|get up|got up|person|sep:auf
ankommen|-|angekommen|sein|arrive|arrived|person|place:arrive transport sep:an
fernsehen|sieh|ferngesehen|haben|watch TV|watched TV|person|sep:fern
frühstücken|-|gefrühstückt|haben|have breakfast|had breakfast|person|place:eat,outdoor with
"""

# Irregular present tenses (ich, du, er/sie/es, wir, ihr, sie).
PRESENT = {
    "sein": ("bin", "bist", "ist", "sind", "seid", "sind"),
    "haben": ("habe", "hast", "hat", "haben", "habt", "haben"),
    "mögen": ("mag", "magst", "mag", "mögen", "mögt", "mögen"),
    "wissen": ("weiß", "weißt", "weiß", "wissen", "wisst", "wissen"),
}
PAST = {  # Präteritum, used for sein and haben where German prefers it to the Perfekt
    "sein": ("war", "warst", "war", "waren", "wart", "waren"),
    "haben": ("hatte", "hattest", "hatte", "hatten", "hattet", "hatten"),
}
# modal: present forms, English ("modal": can/may/...; "lexical": takes do-support), English words
MODALS = {
    "können": (("kann", "kannst", "kann", "können", "könnt", "können"), "modal", "can"),
    "dürfen": (("darf", "darfst", "darf", "dürfen", "dürft", "dürfen"), "modal", "may"),
    "sollen": (("soll", "sollst", "soll", "sollen", "sollt", "sollen"), "modal", "should"),
    "möchten": (("möchte", "möchtest", "möchte", "möchten", "möchtet", "möchten"), "modal", "would like to"),
    "wollen": (("will", "willst", "will", "wollen", "wollt", "wollen"), "lexical", "want to"),
    "müssen": (("muss", "musst", "muss", "müssen", "müsst", "müssen"), "lexical", "have to"),
}

# (German subject, object, dative; English subject, object) for ich, du, er, sie, es, wir, ihr, sie (plural)
PRONOUNS = [
    ("ich", "mich", "mir", "I", "me", 0), ("du", "dich", "dir", "you", "you", 1),
    ("er", "ihn", "ihm", "he", "him", 2), ("sie", "sie", "ihr", "she", "her", 2),
    ("es", "es", "ihm", "it", "it", 2), ("wir", "uns", "uns", "we", "us", 3),
    ("ihr", "euch", "euch", "you", "you", 4), ("sie", "sie", "ihnen", "they", "them", 5),
]
NAMES = [("Anna", "she"), ("Maria", "she"), ("Julia", "she"), ("Lena", "she"), ("Sophie", "she"),
         ("Emma", "she"), ("Paul", "he"), ("Lukas", "he"), ("Thomas", "he"), ("Peter", "he"),
         ("Felix", "he"), ("Jonas", "he")]
CITIES = [("Berlin", "Berlin"), ("Hamburg", "Hamburg"), ("München", "Munich"), ("Köln", "Cologne"),
          ("Frankfurt", "Frankfurt"), ("Wien", "Vienna"), ("Zürich", "Zurich"), ("Paris", "Paris"),
          ("London", "London"), ("Rom", "Rome"), ("Prag", "Prague"), ("Madrid", "Madrid")]
POSSESSED = {"Mann": ("husband", "husbands"), "Frau": ("wife", "wives")}  # "ihr Mann" = "her husband"
POSSESSIVES = [("mein", "my"), ("dein", "your"), ("sein", "his"), ("ihr", "her"), ("unser", "our")]
NUMBERS = [("zwei", "two"), ("drei", "three"), ("vier", "four"), ("fünf", "five"), ("sechs", "six"),
           ("sieben", "seven"), ("acht", "eight"), ("neun", "nine"), ("zehn", "ten"), ("elf", "eleven"),
           ("zwölf", "twelve")]
DAYS = [("Montag", "Monday"), ("Dienstag", "Tuesday"), ("Mittwoch", "Wednesday"), ("Donnerstag", "Thursday"),
        ("Freitag", "Friday"), ("Samstag", "Saturday"), ("Sonntag", "Sunday")]
TIMES_PRESENT = [("heute", "today"), ("jetzt", "now"), ("am Morgen", "in the morning"),
                 ("am Nachmittag", "in the afternoon"), ("am Abend", "in the evening"),
                 ("am Wochenende", "on the weekend"), ("jeden Tag", "every day"),
                 ("jeden Morgen", "every morning"), ("im Sommer", "in summer"), ("im Winter", "in winter")]
TIMES_PAST = [("gestern", "yesterday"), ("gestern Abend", "last night"), ("heute Morgen", "this morning"),
              ("letzte Woche", "last week"), ("letztes Jahr", "last year"), ("letzten Sommer", "last summer")]
TIMES_FUTURE = [("morgen", "tomorrow"), ("heute", "today"), ("am Wochenende", "on the weekend"),
                ("nächste Woche", "next week"), ("jetzt", "now")]
FREQUENCY = [("oft", "often"), ("immer", "always"), ("manchmal", "sometimes"), ("selten", "rarely"),
             ("nie", "never")]
MANNER = [("schnell", "quickly"), ("langsam", "slowly"), ("gut", "well"), ("laut", "loudly"),
          ("leise", "quietly"), ("allein", "alone")]
# weather: German clause (verb last, for subordinate clauses), English progressive, English simple,
# German past clause (verb last), English past
WEATHER = [
    ("es regnet", "it is raining", "it rains", "es geregnet hat", "it was raining"),
    ("es schneit", "it is snowing", "it snows", "es geschneit hat", "it was snowing"),
    ("die Sonne scheint", "the sun is shining", "the sun shines", "die Sonne geschienen hat", "the sun was shining"),
    ("es kalt ist", "it is cold", "it is cold", "es kalt war", "it was cold"),
    ("es heiß ist", "it is hot", "it is hot", "es heiß war", "it was hot"),
]
# reasons for "weil": ("adj", German adjective, English) uses sein; ("noun", German noun, English
# adjective) uses haben: "weil er Hunger hat" = "because he is hungry"
REASONS = {
    "hungry": [("adj", "hungrig", "hungry"), ("noun", "Hunger", "hungry")],
    "thirsty": [("adj", "durstig", "thirsty"), ("noun", "Durst", "thirsty")],
    "tired": [("adj", "müde", "tired"), ("adj", "krank", "sick")],
    "happy": [("adj", "glücklich", "happy")],
    "sad": [("adj", "traurig", "sad"), ("noun", "Angst", "afraid")],
}
REASONS_OF_VERB = {"essen": "hungry", "fressen": "hungry", "kochen": "hungry", "bestellen": "hungry",
                   "trinken": "thirsty", "schlafen": "tired", "bleiben": "tired", "sitzen": "tired",
                   "lachen": "happy", "tanzen": "happy", "singen": "happy", "weinen": "sad"}
