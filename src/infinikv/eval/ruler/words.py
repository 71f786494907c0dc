"""Data: the built-in word list RULER's keys and cwe/fwe words are drawn from (adjectives,
nouns, verbs), in place of ``wonderwords``. A data table, exempt from the 300-line rule."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


ADJECTIVES = sorted(
    set(
        """
        able abrupt absent acidic active adorable afraid agile alert amber ancient angry anxious
        arctic ashamed awake awful bald bashful bitter bland blissful bold boring brave breezy brief
        bright brisk broad broken bumpy busy calm capable careful cheap cheerful chilly chubby
        classic clean clever cloudy clumsy coastal cold colossal cool cosmic cozy crazy creamy
        crisp crooked cruel curly curved cute damp dark dazzling deep delicate dense dizzy dry
        dusty eager early earthy elastic elegant empty endless equal exotic faint fair famous
        fancy fast fearless fierce filthy flat fluffy fragile frantic free fresh friendly frosty
        funny fuzzy gentle giant gifted glad gloomy glossy golden graceful grand greasy great
        grumpy handsome happy hard harsh hasty heavy hidden hollow honest huge humble hungry icy
        idle jolly juicy keen kind large lazy light little lively lonely loud lovely lucky
        magnetic massive meek mellow merry mighty misty modern moldy muddy narrow nasty neat
        nervous noble noisy odd old orange polite proud purple quaint quick quiet rapid rare raw
        ready rich rigid ripe rough round royal rusty sad salty scarlet shiny short shy silent
        silly silver simple sleepy slim slow small smooth soft solid sour spicy steady steep
        sticky stormy strange strong sturdy sunny super sweet swift tall tame tender thick thin
        tidy tiny tough tricky vast velvet violet vivid warm wary weak wet wicked wide wild windy
        wise witty wooden young zany zealous
        """.split()
    )
)
NOUNS = sorted(
    set(
        """
        acorn actor airport album anchor angle ankle apple apron arch arrow artist attic avenue
        badge bagel bakery balcony ball balloon banana band banjo barn basket beach beacon bean
        bear beard bed bee bell belt bench berry bicycle bird biscuit blanket blossom boat bone
        book boot bottle bowl box bracelet branch bread breeze brick bridge broom brush bucket
        bun bus butter button cabin cable cactus cake camel camera candle canoe canyon cap
        captain car carpet carrot castle cat cave cellar chair chalk cheese cherry chicken
        chimney circle city clock cloud clover coat coconut coin comet compass cookie copper
        coral corn cottage cotton cow crab crane crayon cricket crown cup curtain cushion daisy
        deer desert desk diamond dinner doctor dog dolphin donkey door dragon drawer dream drum
        duck eagle earth elbow engine envelope eraser fabric falcon farm feather fence fern
        ferry field finger fire fish flag flame flower flute fog forest fork fountain fox frog
        garden garlic gate giraffe glacier glass glove goat grape grass guitar hammer harbor
        harp hat hawk helmet hill hive honey horse hotel house island jacket jar jelly jewel
        kettle key kitten kite ladder lake lamp lantern lemon letter library lily lion lizard
        lobster lock magnet mango map marble market meadow melon mirror monkey moon mountain
        mouse muffin mushroom nail napkin needle nest net notebook oak ocean octopus olive onion
        orchard otter owl oyster paddle palace panda paper parrot peach peanut pear pebble
        pencil pepper piano pillow pine pirate planet plate plum pocket pond potato pumpkin
        puppy quilt rabbit radio rain raven ribbon river road robot rock rocket roof rose
        saddle sail salmon sandal saucer scarf school seal shadow shark sheep shell ship shoe
        shovel silk singer skate sled snail snake sock sofa spider spoon squirrel stable star
        statue stone storm stove stream street sugar sun swan sweater table tail teapot tent
        thunder tiger toast tomato tower tractor train tree trumpet tulip tunnel turtle
        umbrella valley vase violin wagon wallet walnut whale wheel whistle window wolf zebra
        """.split()
    )
)
VERBS = sorted(
    set(
        """
        accept admire allow answer arrive attach bake balance bathe battle beg behave belong
        blink boil borrow bounce breathe brush build bury calculate carry carve celebrate chase
        cheer chew clap climb collect comb compare complain cough count crawl cross dance decide
        deliver depend describe dig divide drift drown dust escape explain fetch fix float fold
        follow gather giggle glow grab grin guard guess hammer hang harvest hop hover hug hum
        hunt hurry imagine invent jog juggle jump kneel knit knock laugh launch lean lick lift
        listen march melt mend mix nod obey observe open paint pause peel plant play polish
        pour pray prepare pretend promise pull punch push race reach read relax remember repair
        rescue rest rhyme ride roar roll rush scatter scrub search settle sew shake shiver shout
        sing sip skip slide smile sneeze sniff spill spin splash squeeze stare stir stretch
        swim swing taste teach tease throw tickle travel trot tumble twist visit wander wash
        whisper wink wobble worry wrap write yawn yell zoom
        """.split()
    )
)
WORDS = sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS))
